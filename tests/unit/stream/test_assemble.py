"""Stage 1: completion rules and catalog-driven reduction across ranks."""

from __future__ import annotations

import itertools
import math
import struct
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from probewire.instrument.wire import RankStep, series_key
from probewire.stream.assemble import StepAssembler
from probewire.stream.records import ReducedStep
from probewire.stream.reduce import reduce_step

LOSS, TOK, G2, TAU = (
    series_key(n) for n in ("loss.sum", "loss.tokens", "grad.norm_sq", "step.duration")
)


def rec(rank: int, step: int = 0, world: int = 4, coords: dict | None = None, **values) -> RankStep:
    keys = {"loss": LOSS, "tok": TOK, "g2": G2, "tau": TAU}
    return RankStep(
        run_id="r",
        step=step,
        rank=rank,
        world_size=world,
        host="h",
        coords=coords or {"dp": rank},
        values={keys[k]: v for k, v in values.items() if v is not None},
    )


def test_sums_are_summed_maxima_maxed_and_dp_replicas_counted_once():
    rng = np.random.default_rng(0)
    sums, toks, taus = rng.random(4) * 100, rng.integers(1, 50, 4), rng.random(4)
    g2 = 2.5  # all-reduced gradient: identical on every data-parallel rank, so only its
    # owner (dp=0) reports it (``instrument.parallel``); the stream sums what ranks send
    records = [
        rec(
            r,
            loss=float(sums[r]),
            tok=float(toks[r]),
            g2=g2 if r == 0 else None,
            tau=float(taus[r]),
        )
        for r in range(4)
    ]
    out = reduce_step("r", 0, 4, records, "all_ranks")
    assert out.reduced[LOSS] == pytest.approx(float(np.sum(sums, dtype=np.float64)), rel=1e-12)
    assert out.reduced[TOK] == float(np.sum(toks))
    assert out.reduced[TAU] == float(np.max(taus))
    assert out.reduced[G2] == g2  # not 4 * g2


def test_tensor_parallel_layout_counts_loss_once_and_sums_sharded_gradient():
    """2 dp x 2 tp: the loss is replicated over tp, the gradient sharded over tp, replicated
    over dp (each tp shard reported by its dp=0 owner). Reduced values equal the
    single-process ones."""
    shard_sq = {0: 1.25, 1: 0.75}  # squared norm of each tp shard
    loss = {0: (10.0, 4.0), 1: (30.0, 6.0)}  # (sum, count) per dp replica
    records = [
        rec(
            rank=2 * dp + tp,
            coords={"dp": dp, "tp": tp},
            loss=loss[dp][0],
            tok=loss[dp][1],
            g2=shard_sq[tp] if dp == 0 else None,
            tau=0.1,
        )
        for dp in (0, 1)
        for tp in (0, 1)
    ]
    out = reduce_step("r", 0, 4, records, "all_ranks")
    assert out.reduced[LOSS] / out.reduced[TOK] == pytest.approx(40.0 / 10.0)
    assert math.sqrt(out.reduced[G2]) == pytest.approx(math.sqrt(2.0))


def test_replicas_count_once_when_every_rank_sends_the_same_series():
    """2 dp x 2 tp, every rank sending the same series in the same order (the assembler's
    fast path): the loss, replicated over tp, is summed over the dp replicas only; the
    step time is maxed over every rank."""
    loss = {0: (10.0, 4.0), 1: (30.0, 6.0)}
    taus = {0: 0.1, 1: 0.4, 2: 0.2, 3: 0.3}
    records = [
        rec(
            rank=2 * dp + tp,
            coords={"dp": dp, "tp": tp},
            loss=loss[dp][0],
            tok=loss[dp][1],
            tau=taus[2 * dp + tp],
        )
        for dp in (0, 1)
        for tp in (0, 1)
    ]
    assert len({tuple(r.values) for r in records}) == 1
    out = reduce_step("r", 0, 4, records, "all_ranks")
    assert (out.reduced[LOSS], out.reduced[TOK], out.reduced[TAU]) == (40.0, 10.0, 0.4)


def test_nan_component_stays_visible():
    out = reduce_step(
        "r",
        0,
        2,
        [rec(0, world=2, loss=math.nan, tok=3.0), rec(1, world=2, loss=1.0, tok=3.0)],
        "all_ranks",
    )
    assert math.isnan(out.reduced[LOSS])


def test_complete_when_all_ranks_report_and_duplicates_ignored():
    asm = StepAssembler(deadline_s=30)
    assert asm.add(rec(0, world=2, loss=1.0, tok=1.0), now=0).completed == []
    assert asm.add(rec(0, world=2, loss=1.0, tok=1.0), now=0).duplicate
    done = asm.add(rec(1, world=2, loss=2.0, tok=1.0), now=0).completed
    assert [(d.step, d.complete_reason, d.ranks_missing) for d in done] == [(0, "all_ranks", [])]
    again = asm.add(rec(1, world=2, loss=2.0, tok=1.0), now=1)
    assert again.duplicate and again.completed == [] and again.late is None


def test_deadline_emits_with_missing_ranks_and_later_arrival_is_late():
    asm = StepAssembler(deadline_s=5)
    asm.add(rec(0, world=3, loss=1.0, tok=1.0), now=0)
    assert asm.expire(now=4.9) == []
    (done,) = asm.expire(now=5.0)
    assert done.complete_reason == "deadline" and done.ranks_missing == [1, 2]
    late = asm.add(rec(2, world=3, loss=1.0, tok=1.0), now=6)
    assert late.late is not None and late.late.rank == 2 and late.completed == []


def test_a_later_step_never_closes_an_earlier_one_whose_rank_comes_within_the_deadline():
    """Rank 1 sends step 7 before step 5 (out of order in one partition): step 7 completes,
    step 5 waits for rank 1 and is reduced with both ranks (issue 40: a later step closed
    it without rank 1, whose message then came as late data)."""
    asm = StepAssembler(deadline_s=30)
    asm.add(rec(0, step=5, world=2, tok=1.0), now=0, partition=1)
    asm.add(rec(0, step=7, world=2, tok=1.0), now=0, partition=1)
    done = asm.add(rec(1, step=7, world=2, tok=1.0), now=1, partition=1).completed
    assert [(d.step, d.complete_reason) for d in done] == [(7, "all_ranks")]
    result = asm.add(rec(1, step=5, world=2, tok=2.0), now=29, partition=1)
    assert result.late is None
    assert [(d.step, d.ranks_missing, d.reduced[TOK]) for d in result.completed] == [(5, [], 3.0)]


def test_a_refused_rank_does_not_hold_its_step_and_is_named_missing():
    """A rank whose message is dead-lettered is accounted for: its step is reduced without
    it at once (ranks_missing names it), not at the deadline; a refusal of a rank outside
    the world, of a replay or of a step already reduced changes nothing."""
    asm = StepAssembler(deadline_s=30)
    asm.add(rec(0, step=3, world=3, tok=1.0), now=0)
    assert asm.refused(rec(5, step=3, world=3, tok=1.0)) == []
    assert asm.refused(rec(1, step=3, world=3, tok=1e30)) == []
    (done,) = asm.add(rec(2, step=3, world=3, tok=2.0), now=1).completed
    assert (done.ranks_reporting, done.ranks_missing, done.reduced[TOK]) == ([0, 2], [1], 3.0)
    assert asm.refused(rec(1, step=3, world=3, tok=1e30)) == [] and asm.pending == 0


def test_a_refusal_before_its_step_starts_nothing_and_is_counted_when_the_step_comes():
    """A refused message that comes first (a poison rank ahead of the others, or a hostile
    one naming a future step) starts no step: nothing is reduced at its deadline, so no
    empty step reaches stage 2 before the real one. The step's ranks, when they come,
    complete it without waiting for the refused rank; its genuine message, if it then
    comes, still counts, once."""
    asm = StepAssembler(deadline_s=5)
    assert asm.refused(rec(1, step=4, world=2, tok=1e30)) == []
    assert asm.refused(rec(0, step=90, world=2, tok=1e30)) == []
    assert asm.pending == 0 and asm.expire(now=100) == []
    (done,) = asm.add(rec(0, step=4, world=2, tok=5.0), now=101).completed
    assert (done.ranks_missing, done.reduced[TOK]) == ([1], 5.0)
    assert asm.refused(rec(1, step=6, world=2, tok=1e30)) == []
    assert asm.add(rec(1, step=6, world=2, tok=2.0), now=102).completed == []
    (done,) = asm.add(rec(0, step=6, world=2, tok=1.0), now=102).completed
    assert (done.ranks_missing, done.reduced[TOK]) == ([], 3.0)


def test_a_rebalance_drops_every_pending_step_and_its_messages_assemble_again():
    """At a rebalance the pending steps are forgotten (the consumer reads their messages
    again from the committed offset): none is reduced here at its deadline without the
    ranks read after the rebalance, and the re-read messages complete the step once."""
    asm = StepAssembler(deadline_s=5)
    asm.add(rec(0, step=4, world=2, tok=1.0), now=0, partition=1)
    asm.add(rec(0, step=5, world=2, tok=1.0), now=0, partition=2)
    assert sorted(asm.drop_pending()) == [("r", 4), ("r", 5)]
    assert asm.expire(now=10) == []
    assert asm.add(rec(0, step=4, world=2, tok=1.0), now=11, partition=1).completed == []
    (done,) = asm.add(rec(1, step=4, world=2, tok=2.0), now=11, partition=1).completed
    assert (done.ranks_missing, done.reduced[TOK]) == ([], 3.0)


def test_reduced_step_wire_round_trip_keeps_nonfinite():
    out = reduce_step("r", 3, 2, [rec(0, step=3, world=2, loss=math.inf, tok=2.0)], "deadline")
    back = ReducedStep.from_bytes(out.to_bytes())
    assert back.step == 3 and back.ranks_missing == [1] and math.isinf(back.reduced[LOSS])
    assert back.per_rank[0][TOK] == 2.0


def scan_rec(rank: int, step: int, world: int, abs_max: float, n: float) -> RankStep:
    labels = {"tensor": "blocks.0", "kind": "fwd"}
    return RankStep(
        run_id="r",
        step=step,
        rank=rank,
        world_size=world,
        host="h",
        coords={"tp": rank},
        replay=True,
        values={series_key("tensor.abs_max", labels): abs_max, series_key("tensor.n", labels): n},
    )


def test_a_replay_of_a_completed_step_is_reduced_apart_once():
    asm = StepAssembler(deadline_s=30)
    for r in range(2):
        asm.add(rec(r, step=7, world=2, loss=1.0, tok=1.0), now=0)
    assert asm.add(rec(1, step=8, world=2, loss=1.0, tok=1.0), now=0).completed == []
    # the ranks' ring buffers: step 7's scan detail, after step 7 completed
    assert asm.add(scan_rec(0, 7, 2, abs_max=3.0, n=10.0), now=1).completed == []
    assert asm.add(scan_rec(0, 7, 2, abs_max=3.0, n=10.0), now=1).duplicate
    (done,) = asm.add(scan_rec(1, 7, 2, abs_max=5.0, n=6.0), now=1).completed
    assert (done.step, done.complete_reason, done.ranks_missing) == (7, "replay", [])
    labels = {"tensor": "blocks.0", "kind": "fwd"}
    assert done.reduced == {
        series_key("tensor.abs_max", labels): 5.0,
        series_key("tensor.n", labels): 16.0,
    }
    # a second dump's copy of the same rank's replay is counted once, and step 8 still waits
    again = asm.add(scan_rec(1, 7, 2, abs_max=5.0, n=6.0), now=2)
    assert again.duplicate and again.completed == [] and asm.pending == 1


def test_a_replay_with_a_missing_rank_is_reduced_at_the_deadline():
    asm = StepAssembler(deadline_s=5)
    asm.add(scan_rec(0, 3, 2, abs_max=1.0, n=4.0), now=0)
    (done,) = asm.expire(now=5)
    assert done.complete_reason == "replay" and done.ranks_missing == [1]


@pytest.mark.parametrize(
    "parts",
    [
        [math.inf, -math.inf, 1.0],  # a blown-up tensor: no sum (fsum raises on these)
        [1e308, 1e308, -1.0],  # finite parts past float64 (fsum overflows)
        [-1e308, -1e308, 5.0],
        [math.inf, 2.0, 3.0],
        [math.nan, math.inf, -math.inf],
    ],
)
def test_non_finite_and_overflowing_sums_reduce_as_numpy_sums(parts):
    """A sum (grad.norm_sq: replicated over no group, so every rank is its own class) whose parts
    are ±inf or overflow reduces like NumPy's float64 sum instead of raising."""
    records = [rec(r, g2=v, world=3) for r, v in enumerate(parts)]
    with np.errstate(all="ignore"):
        expected = float(np.sum(np.array(parts, dtype=np.float64)))
    got = reduce_step("r", 0, 3, records, "all_ranks").reduced[G2]
    assert got == expected or (math.isnan(got) and math.isnan(expected))


def test_series_some_ranks_lack_reduce_over_the_ranks_that_sent_them():
    """Rank 1 lacks the loss, rank 3 lacks the step time: each series' representatives are
    the ranks that sent it (the general path beside the every-rank one)."""
    sums, taus = [1.0, None, 4.0, 8.0], [0.5, 0.25, 0.75, None]
    records = [rec(r, loss=sums[r], tau=taus[r]) for r in range(4)]
    out = reduce_step("r", 0, 4, records, "all_ranks")
    assert out.reduced[LOSS] == float(np.sum([1.0, 4.0, 8.0]))
    assert out.reduced[TAU] == float(np.max([0.5, 0.25, 0.75]))


@pytest.mark.parametrize(
    "parts, expected",
    [
        ([1e308, 1e308, -1e308], 1e308),  # fsum overflows on the way; the exact sum is in range
        ([1e308, 1e308, -math.inf], -math.inf),  # an infinite part wins over an overflow
        ([1.7976931348623157e308, 2.0**970, -(2.0**918)], 1.7976931348623157e308),
        ([1.7976931348623157e308, 2.0**970], math.inf),  # halfway past the largest: even, inf
        ([-1e308, -1e308, 1.0], -math.inf),
    ],
)
def test_sums_are_the_exact_sum_rounded_whatever_the_ranks_order(parts, expected):
    """The sum is the exact sum of the parts correctly rounded (±inf past the float64 range),
    for every order of the ranks: a step split into rank blocks (``partial``) sums to the
    same value. The old rule, NumPy's running sum past an overflow, gave inf, NaN or
    -inf here depending on the order."""
    for order in itertools.permutations(range(len(parts))):
        records = [rec(r, g2=parts[i], world=len(parts)) for r, i in enumerate(order)]
        got = reduce_step("r", 0, len(parts), records, "all_ranks").reduced[G2]
        assert struct.pack("<d", got) == struct.pack("<d", expected)


def test_a_metric_replicated_over_no_group_counts_every_rank_whatever_its_coordinates():
    """Rank 1 sends no coordinates (its class would be dp=1) and rank 2 claims dp=1: the
    gradient's squares (replicated over no group) count both; the loss (replicated over tp)
    counts one representative of dp=1."""
    records = [rec(0, g2=1.0, loss=1.0), rec(1, g2=2.0, loss=2.0, coords={})]
    records[1].coords.clear()
    records += [rec(2, g2=4.0, loss=4.0, coords={"dp": 1}), rec(3, g2=8.0, loss=8.0)]
    out = reduce_step("r", 0, 4, records, "all_ranks")
    assert (out.reduced[G2], out.reduced[LOSS]) == (15.0, 1.0 + 2.0 + 8.0)


def exact_reference(parts: list[float]) -> float:
    """The exact rational sum, rounded once (±inf past the float64 range)."""
    exact = sum(map(Fraction, parts), Fraction(0))
    try:
        return float(exact)
    except OverflowError:
        return math.inf if exact > 0 else -math.inf


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.floats(allow_nan=False, allow_infinity=False)
        | st.sampled_from([1e308, -1e308, 1.7976931348623157e308, 2.0**970, -0.0, 5e-324]),
        min_size=1,
        max_size=12,
    ),
    st.randoms(use_true_random=False),
)
def test_a_finite_sum_is_the_exact_sum_rounded_once_in_any_order(parts, random):
    shuffled = list(parts)
    random.shuffle(shuffled)
    for values in (parts, shuffled):
        records = [rec(r, g2=v, world=len(values)) for r, v in enumerate(values)]
        got = reduce_step("r", 0, len(values), records, "all_ranks").reduced[G2]
        assert struct.pack("<d", got) == struct.pack("<d", exact_reference(parts))
