"""ReducedStep's wire form: the fast paths (every rank the same series in the same order,
every series present) write and read exactly what the general layout does."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

from probewire.instrument.catalog import Loss, Tensor
from probewire.instrument.wire import series_key
from probewire.stream.records import CompleteReason, RecordError, ReducedStep

LOSS, TOK = series_key(Loss.SUM), series_key(Loss.TOKENS)
ABS = series_key(Tensor.ABS_MAX, {"tensor": "b0", "kind": "fwd"})


def reference_bytes(step: ReducedStep) -> bytes:
    """The layout as the docstring states it, one cell at a time (independent of the
    code under test): u32 header size, header, reduced [K], mask [K], values [R, K],
    mask [R, K]; keys sorted, ranks sorted, absent cells NaN with mask 0."""
    keys = sorted(set(step.reduced).union(*(v.keys() for v in step.per_rank.values())))
    ranks = sorted(step.per_rank)
    reduced = [step.reduced.get(k, math.nan) for k in keys]
    reduced_mask = [int(k in step.reduced) for k in keys]
    values = [[step.per_rank[r].get(k, math.nan) for k in keys] for r in ranks]
    mask = [[int(k in step.per_rank[r]) for k in keys] for r in ranks]
    header = json.dumps(
        {
            "run_id": step.run_id,
            "step": step.step,
            "world_size": step.world_size,
            "ranks_reporting": step.ranks_reporting,
            "ranks_missing": step.ranks_missing,
            "hosts": {str(r): h for r, h in step.hosts.items()},
            "coords": {str(r): c for r, c in step.coords.items()},
            "complete_reason": step.complete_reason,
            "ranks": ranks,
            "keys": [k[0] + "".join(f"|{a}={b}" for a, b in k[1]) for k in keys],
        },
        separators=(",", ":"),
    ).encode()
    return b"".join(
        (
            struct.pack("<I", len(header)),
            header,
            np.array(reduced, np.float64).tobytes(),
            np.array(reduced_mask, np.uint8).tobytes(),
            np.array(values, np.float64).reshape(len(ranks), len(keys)).tobytes(),
            np.array(mask, np.uint8).reshape(len(ranks), len(keys)).tobytes(),
        )
    )


def make(per_rank: dict[int, dict], reduced: dict) -> ReducedStep:
    return ReducedStep(
        run_id="r",
        step=4,
        world_size=3,
        ranks_reporting=sorted(per_rank),
        ranks_missing=[r for r in range(3) if r not in per_rank],
        reduced=reduced,
        per_rank=per_rank,
        hosts={r: f"h{r}" for r in per_rank},
        coords={r: {"dp": r} for r in per_rank},
    )


CASES = {
    "same series, same order": (
        {0: {LOSS: 1.0, TOK: 2.0}, 1: {LOSS: 3.0, TOK: 4.0}},
        {LOSS: 4.0, TOK: 6.0},
    ),
    # same series in another order: one column order for both would swap rank 1's values
    "same series, other order": (
        {0: {LOSS: 1.0, TOK: 2.0}, 1: {TOK: 4.0, LOSS: 3.0}},
        {LOSS: 4.0, TOK: 6.0},
    ),
    # every rank the same series, the step one more (reduced only): the ranks' mask is
    # not all ones but the same row for every rank
    "same series, a reduced-only series": (
        {0: {LOSS: 1.0, TOK: 2.0}, 1: {TOK: 4.0, LOSS: math.nan}, 2: {LOSS: 0.0, TOK: -0.0}},
        {LOSS: math.nan, TOK: 6.0, ABS: 7.0},
    ),
    "a rank without a series": (
        {0: {LOSS: 1.0, TOK: 2.0, ABS: 5.0}, 2: {ABS: math.inf}},
        {ABS: math.inf},
    ),
    "non-finite values": (
        {0: {LOSS: math.nan, TOK: -math.inf}, 1: {LOSS: 1.0, TOK: 1.0}},
        {LOSS: math.nan, TOK: -math.inf},
    ),
    "no rank": ({}, {}),
}


@pytest.mark.parametrize("name", CASES)
def test_bytes_match_the_reference_layout_and_read_back(name):
    per_rank, reduced = CASES[name]
    step = make(per_rank, reduced)
    data = step.to_bytes()
    assert data == reference_bytes(step)
    back = ReducedStep.from_bytes(data)
    for rank, values in per_rank.items():  # every cell where it was, NaN included
        assert list(back.per_rank[rank]) == sorted(values)  # in the layout's key order
        for key, value in values.items():
            got = back.per_rank[rank][key]
            assert np.float64(got).tobytes() == np.float64(value).tobytes()
    assert back.reduced.keys() == reduced.keys()
    assert back.to_bytes() == data


def test_a_truncated_step_is_a_record_error():
    data = make(*CASES["a rank without a series"]).to_bytes()
    with pytest.raises(RecordError):
        ReducedStep.from_bytes(data[:-3])


def test_a_header_text_that_looks_like_the_keys_field_reads_back():
    """The keys are read from the header's last field; a run id or host holding the same
    characters stays a string (JSON escapes its quotes)."""
    step = make(*CASES["same series, same order"])
    step.run_id = 'run,"keys":["x"]}'
    step.hosts = {0: ',"keys":', 1: '"}'}
    data = step.to_bytes()
    assert data == reference_bytes(step)
    back = ReducedStep.from_bytes(data)
    assert (back.run_id, back.hosts, back.reduced, back.per_rank) == (
        step.run_id,
        step.hosts,
        step.reduced,
        step.per_rank,
    )


def test_a_label_without_a_value_is_a_record_error():
    data = make(*CASES["same series, same order"]).to_bytes()
    bad = data.replace(b"|tensor=b0", b"|tensorb0").replace(b'"loss.sum"', b'"loss.sum|x"')
    size = struct.unpack_from("<I", data)[0] + len(bad) - len(data)
    with pytest.raises(RecordError, match="label without '='"):
        ReducedStep.from_bytes(struct.pack("<I", size) + bad[4:])


def test_complete_reasons_keep_their_stored_values_and_read_back_as_the_enum():
    """The values ClickHouse stores are unchanged; a step's reason reads back as the enum
    member (equal to its text); a reason the enum does not know is a RecordError (a dead
    letter), not a step that stage 2 would branch on wrongly."""
    assert [r.value for r in CompleteReason] == [
        "all_ranks",
        "deadline",
        "later_step",
        "late",
        "replay",
        "detail",
        "scan",
        "after_gap",
    ]
    step = make({0: {LOSS: 1.0}}, {LOSS: 1.0})
    for reason in CompleteReason:
        step.complete_reason = reason
        back = ReducedStep.from_bytes(step.to_bytes())
        assert back.complete_reason is reason and back.complete_reason == reason.value
    step.complete_reason = "finished"  # type: ignore[assignment]
    with pytest.raises(RecordError, match="finished"):
        ReducedStep.from_bytes(step.to_bytes())
