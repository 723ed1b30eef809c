"""Stage 1 by rank block (``stream.partial``): the blocks' partial states, through their wire
form, merge into the step ``reduce_step`` makes of all the records, bit for bit
(hypothesis), and into a float64 NumPy reference on a concrete step."""

from __future__ import annotations

import math
import struct
from contextlib import ExitStack
from fractions import Fraction
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probewire.instrument.catalog import Comm, Grad, Loss, Memory, Moe, Optim, Reduction, System
from probewire.instrument.catalog import Tensor as T
from probewire.instrument.wire import RankStep, series_key
from probewire.stream import partial
from probewire.stream import reduce as reduction
from probewire.stream.inputs import PER_RANK
from probewire.stream.partial import Partial, merge, partial_of
from probewire.stream.records import CompleteReason, RecordError, ReducedStep
from probewire.stream.reduce import reduce_step

TENSOR = {"tensor": "blocks.0.mlp", "kind": "grad"}
SERIES = [
    series_key(Loss.SUM, {"source": "web"}),  # sum, replicated over tp
    series_key(Loss.TOKENS, {"source": "web"}),
    series_key(Loss.SUM),
    series_key(Grad.NORM_SQ, {"group": "other"}),  # sum, replicated over no group
    series_key(System.STEP_TIME),  # max over every rank
    series_key(System.FLOPS),  # sum, replicated over pp and tp
    series_key(Memory.CAPACITY),  # min over every rank
    series_key(Memory.PEAK_ALLOCATED),
    series_key(Comm.WAIT, {"op": "all_reduce"}),
    series_key(Optim.LR, {"param_group": "0"}),  # max, replicated over every group
    series_key(Moe.MARGIN_MIN, {"layer": "3"}),  # min, replicated over tp
    series_key(T.SUM_SQ, TENSOR),
    series_key(T.ABS_MAX, TENSOR),
    series_key(T.N, TENSOR),
    series_key("export.dropped_total"),  # per rank: not reduced
    series_key("test.median"),  # no catalog metric is a median: see ``medians``
    series_key("test.median_tp", {"layer": "1"}),
]
HUGE = [1e308, -1e308, 2.0**960, -(2.0**1000), float(np.finfo(np.float64).max), -1.7e308]
VALUES = st.one_of(
    st.floats(),  # NaN (any payload), ±inf, subnormals, -0.0
    st.sampled_from([0.0, -0.0, 1.0, 0.1, 5e-324, math.nan, math.inf, -math.inf, *HUGE]),
    st.integers(0, 4096).map(float),
)
EXTREME = st.sampled_from([*HUGE, math.inf, -math.inf, 1.0, -0.0])  # overflow, ±inf mixed


def medians() -> ExitStack:
    """Two median metrics (one replicated over tp) for the test's steps: the catalog
    declares no median, and ``reduce_step`` and the partials must agree on it all the same."""
    real = reduction._plan
    everyone = reduction._distinguishing(frozenset())
    fake = {
        "test.median": (Reduction.MEDIAN, everyone),
        "test.median_tp": (Reduction.MEDIAN, tuple(g for g in everyone if g != "tp")),
    }
    plan = lambda name: fake.get(name) or real(name)
    stack = ExitStack()
    for module in (reduction, partial):
        stack.enter_context(mock.patch.object(module, "_plan", plan))
    return stack


def bits(values: dict) -> dict:
    """Values to the bit: 0.0 and -0.0 differ, and so do NaNs of other payloads."""
    return {k: struct.pack("<d", v) for k, v in values.items()}


def partial_bits(p: Partial) -> tuple:
    floats = lambda xs: [struct.pack("<d", x) for x in xs]
    return (
        (p.run_id, p.step, p.world_size, p.block, p.ranks, p.hosts, p.coords),
        {
            k: (floats(s.parts), floats(s.big), s.nan, s.pos_inf, s.neg_inf)
            for k, s in p.sums.items()
        },
        bits(p.extrema),
        {k: floats(v) for k, v in p.samples.items()},
        {k: (r, floats(v)) for k, (r, v) in p.classes.items()},
        {r: bits(v) for r, v in p.per_rank.items()},
    )


def layout(rank: int, tp: int, pp: int) -> dict[str, int]:
    return {"dp": rank // (tp * pp), "pp": (rank // tp) % pp, "tp": rank % tp}


def record(rank: int, world: int, coords: dict, values: dict) -> RankStep:
    return RankStep(
        run_id="run", step=7, rank=rank, world_size=world, host=f"node{rank // 4}",
        coords=coords, values=values,
    )  # fmt: skip


@st.composite
def steps(draw) -> tuple[int, int, list[RankStep]]:
    """A step of 1..40 ranks (dp × pp × tp, some not reporting), its block size and records:
    series on every rank in one order (the usual step), or in other orders, or not on some
    ranks."""
    world = draw(st.integers(1, 40))
    tp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 3]))
    reporting = draw(st.sets(st.integers(0, world - 1), min_size=1))
    series = draw(st.lists(st.sampled_from(SERIES), min_size=1, unique=True))
    shape = draw(st.sampled_from(["usual", "orders", "missing"]))
    palette = draw(st.sampled_from([VALUES, EXTREME]))
    records = []
    for rank in sorted(reporting):
        keys = list(series)
        if shape == "missing":
            keys = [k for k in keys if draw(st.booleans())]
        if shape != "usual":
            keys = draw(st.permutations(keys))
        coords = layout(rank, tp, pp)
        if draw(st.integers(0, 9)) == 0:  # a rank without coordinates, or with some
            coords = draw(st.sampled_from([{}, {"dp": coords["dp"]}]))
        records.append(record(rank, world, coords, {k: draw(palette) for k in keys}))
    return world, draw(st.integers(1, world)), draw(st.permutations(records))


def assert_same_step(got: ReducedStep, want: ReducedStep) -> None:
    assert (got.run_id, got.step, got.world_size) == (want.run_id, want.step, want.world_size)
    assert (got.ranks_reporting, got.ranks_missing) == (want.ranks_reporting, want.ranks_missing)
    assert (got.hosts, got.coords) == (want.hosts, want.coords)
    assert list(got.reduced) == list(want.reduced)  # the same series, in the same order
    assert bits(got.reduced) == bits(want.reduced)
    view = {
        r: bits({k: v for k, v in values.items() if k[0] in PER_RANK})
        for r, values in want.per_rank.items()
    }
    assert {r: bits(v) for r, v in got.per_rank.items()} == view
    assert got.complete_reason == want.complete_reason


def by_block(records: list[RankStep], size: int) -> dict[int, list[RankStep]]:
    blocks: dict[int, list[RankStep]] = {}
    for r in records:
        blocks.setdefault(r.rank // size, []).append(r)
    return blocks


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_merged_blocks_equal_the_single_reduction_to_the_bit(case):
    world, size, records = case
    with medians():
        want = reduce_step("run", 7, world, records, CompleteReason.DEADLINE)
        partials = []
        for block, members in sorted(by_block(records, size).items(), reverse=True):
            made = partial_of("run", 7, world, block, members, PER_RANK)
            back = Partial.from_bytes(made.to_bytes())
            assert partial_bits(back) == partial_bits(made)
            partials.append(back)
        got = merge(partials, CompleteReason.DEADLINE, PER_RANK)
    assert_same_step(got, want)


def test_a_replica_class_spanning_blocks_counts_once_by_its_lowest_rank():
    """dp × tp = 3 × 2 in blocks of 3 ranks: dp replica 1 (ranks 2, 3) straddles blocks 0
    and 1. The loss (replicated over tp) counts rank 2's value, not rank 3's as well; the
    gradient (replicated over no group) counts both."""
    loss, g2 = series_key(Loss.SUM), series_key(Grad.NORM_SQ)
    records = [
        record(r, 6, layout(r, 2, 1), {loss: float(r // 2 + 1), g2: float(r + 10)})
        for r in range(6)
    ]
    parts = [partial_of("run", 7, 6, b, m, PER_RANK) for b, m in by_block(records, 3).items()]
    assert parts[0].classes[loss] == ([0, 2], [1.0, 2.0])
    assert parts[1].classes[loss] == ([3, 4], [2.0, 3.0])
    out = merge(parts, CompleteReason.ALL_RANKS, PER_RANK)
    assert out.reduced[loss] == 1.0 + 2.0 + 3.0
    assert out.reduced[g2] == float(np.sum(np.arange(6) + 10.0))


def test_a_concrete_step_equals_a_float64_numpy_reference():
    """dp 5 × tp 2, blocks of 4 ranks, world of 11 (rank 10 silent): uneven token counts,
    dp replica 3 without a valid target (no loss point at all), the gradient's squares owned
    by each dp's tp shards, step times maxed, capacities minimized and a median. The values
    are dyadic, so the float64 sums NumPy forms are exact and must equal the merge's."""
    rng = np.random.default_rng(35)
    tokens = np.array([512.0, 3.0, 1024.0, 0.0, 77.0])  # per dp replica; dp 3 has none
    losses = np.round(rng.random(5) * 4096 * tokens) / 64  # Σ NLL, dyadic
    shards = np.round(rng.random(10) * 2**20) / 2**10  # grad.norm_sq of each rank's shard
    times = rng.random(10)
    capacity = np.round(rng.random(10) * 80) * 2**30
    scan_max = rng.random(10) * 10
    keys = dict(
        loss=series_key(Loss.SUM), tok=series_key(Loss.TOKENS), g2=series_key(Grad.NORM_SQ),
        tau=series_key(System.STEP_TIME), cap=series_key(Memory.CAPACITY),
        amax=series_key(T.ABS_MAX, TENSOR), med=series_key("test.median"),
    )  # fmt: skip
    records = []
    for rank in range(10):
        dp = rank // 2
        values = {
            keys["g2"]: shards[rank], keys["tau"]: times[rank], keys["cap"]: capacity[rank],
            keys["amax"]: scan_max[rank], keys["med"]: times[rank],
        }  # fmt: skip
        if tokens[dp]:
            values |= {keys["loss"]: losses[dp], keys["tok"]: tokens[dp]}
        records.append(
            record(rank, 11, layout(rank, 2, 1), {k: float(v) for k, v in values.items()})
        )
    with medians():
        partials = [
            Partial.from_bytes(partial_of("run", 7, 11, b, m, PER_RANK).to_bytes())
            for b, m in by_block(records, 4).items()
        ]
        out = merge(partials, CompleteReason.DEADLINE, PER_RANK)
    has_tokens = tokens > 0
    assert out.reduced[keys["loss"]] == np.sum(losses[has_tokens], dtype=np.float64)
    assert out.reduced[keys["tok"]] == np.sum(tokens, dtype=np.float64) == 1616.0
    assert out.reduced[keys["g2"]] == np.sum(shards, dtype=np.float64)
    assert out.reduced[keys["tau"]] == np.max(times)
    assert out.reduced[keys["cap"]] == np.min(capacity)
    assert out.reduced[keys["amax"]] == np.max(scan_max)
    assert out.reduced[keys["med"]] == np.median(times)
    assert (out.ranks_missing, sorted(out.per_rank)) == ([10], list(range(10)))
    assert keys["loss"] not in out.per_rank[6] and out.per_rank[8][keys["tok"]] == 77.0
    assert set(out.per_rank[0]) == {keys["loss"], keys["tok"], keys["tau"], keys["cap"]}
    back = ReducedStep.from_bytes(out.to_bytes())  # stage 2 reads it as any reduced step
    assert bits(back.reduced) == bits(out.reduced) and back.per_rank == out.per_rank


FINITE = st.floats(allow_nan=False, allow_infinity=False, max_value=2.0**959, min_value=-(2.0**959))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.lists(FINITE | st.sampled_from([0.1, -0.0, 5e-324]), min_size=1, max_size=20),
        min_size=1,
        max_size=8,
    )
)
def test_the_blocks_exact_parts_sum_to_the_values_sum(blocks):
    """Each block's parts hold its exact sum; fsum over every block's parts is fsum over
    every value, to the bit."""
    states = [partial._sum_state(block) for block in blocks]
    for block, state in zip(blocks, states):
        assert sum(map(Fraction, state.parts)) == sum(map(Fraction, block)) and not state.big
    everything = [v for block in blocks for v in block]
    assert struct.pack("<d", partial._merge_sums(states)) == struct.pack(
        "<d", math.fsum(everything)
    )


@pytest.mark.parametrize(
    "payload",
    [
        None,
        b"",
        b"\x00\x00\x00\x00",
        b"\x05\x00\x00\x00{nope",
        b"\x02\x00\x00\x00{}",
    ],
)
def test_garbage_is_a_record_error_with_a_reason(payload):
    with pytest.raises(RecordError, match="not a partial step"):
        Partial.from_bytes(payload)


def test_a_truncated_or_inconsistent_partial_is_a_record_error():
    g2, loss = series_key(Grad.NORM_SQ), series_key(Loss.SUM)
    records = [record(r, 4, layout(r, 2, 1), {g2: 0.5 * r, loss: 1.0}) for r in range(4)]
    good = partial_of("run", 7, 4, 0, records, PER_RANK).to_bytes()
    for bad in (
        good[:-1],
        good + b"\x00",
        good.replace(b'"ranks":[0,1,2,3]', b'"ranks":[0,1,2,-3]'),
    ):
        with pytest.raises(RecordError, match="not a partial step"):
            Partial.from_bytes(bad)
    assert Partial.from_bytes(good).classes[loss] == ([0, 2], [1.0, 1.0])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_a_record_error(payload):
    try:
        Partial.from_bytes(payload)
    except RecordError as exc:
        assert exc.reason.startswith("not a partial step")


def test_merge_of_no_partial_is_refused():
    with pytest.raises(ValueError, match="at least one block"):
        merge([], CompleteReason.ALL_RANKS, PER_RANK)


def test_a_large_world_in_many_blocks_equals_the_single_reduction():
    """1,000 ranks (dp × pp × tp = 63 × 2 × 8, the last dp incomplete), 16 blocks of 64,
    a few NaNs and ranks without some series: the merge is reduce_step's step to the bit."""
    rng = np.random.default_rng(16)
    keys = SERIES[:15]
    records = []
    for rank in range(1000):
        values = rng.random(len(keys)) * 10.0 ** rng.integers(-3, 6, len(keys))
        values[rng.random(len(keys)) < 0.002] = math.nan
        kept = rng.random(len(keys)) > 0.01
        records.append(
            record(
                rank,
                1000,
                layout(rank, 8, 2),
                {k: float(v) for k, v, on in zip(keys, values, kept) if on},
            )
        )
    want = reduce_step("run", 7, 1000, records, CompleteReason.ALL_RANKS)
    partials = [
        Partial.from_bytes(partial_of("run", 7, 1000, b, m, PER_RANK).to_bytes())
        for b, m in by_block(records, 64).items()
    ]
    assert len(partials) == 16
    assert_same_step(merge(partials, CompleteReason.ALL_RANKS, PER_RANK), want)
