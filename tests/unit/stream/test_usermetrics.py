"""User metrics in the stream: 4 ranks' values through the wire and stage 1, reduced by the
declared reduction and checked against a float64 NumPy reference; names checked on arrival."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probewire.instrument.catalog import Label, User
from probewire.instrument.userlog import points
from probewire.instrument.wire import RankIdentity, WireEncoder, decode_rank_step, message_key
from probewire.stream.reduce import reduce_step
from probewire.stream.usermetrics import user_rows, user_values
from probewire.stream.validate import Bounds, StepValidator

WORLD = 4


def rank_messages(values: dict[str, tuple[str, np.ndarray]], step: int = 7):
    """Each rank's message of ``step`` with its value of every name, decoded as the worker."""
    out = []
    for rank in range(WORLD):
        identity = RankIdentity(run_id="u", rank=rank, world_size=WORLD, coords={"dp": rank})
        pts = [
            p
            for name, (reduction, column) in values.items()
            for p in points(name, float(column[rank]), reduction, rank)
        ]
        payload = WireEncoder(identity.resource_attributes()).encode(step, pts)
        out.append(decode_rank_step(message_key("u", step), payload))
    return out


def test_each_reduction_matches_numpy_over_ranks():
    rng = np.random.default_rng(3)
    values = {
        f"{reduction}_m": (reduction, rng.normal(size=WORLD) * 10.0 ** rng.integers(-3, 4))
        for reduction in ("mean", "sum", "max", "rank0")
    }
    reduced = reduce_step("u", 7, WORLD, rank_messages(values), "all_ranks").reduced
    got = user_values(reduced)
    reference = {
        "mean": lambda v: float(np.mean(v, dtype=np.float64)),
        "sum": lambda v: float(np.sum(v, dtype=np.float64)),
        "max": lambda v: float(np.max(v)),
        "rank0": lambda v: float(v[0]),
    }
    assert set(got) == set(values)
    for name, (reduction, column) in values.items():
        value, stored_reduction = got[name]
        assert stored_reduction == reduction
        assert value == pytest.approx(reference[reduction](column), rel=1e-14, abs=0)
    rows = user_rows("u", 7, reduced)
    assert [(r["name"], r["reduction"]) for r in rows] == sorted(
        (n, r) for n, (r, _) in values.items()
    )
    assert all(r["run_id"] == "u" and r["step"] == 7 for r in rows)


def test_a_mean_over_the_ranks_that_logged_it_and_nonfinite_kept():
    """Two of four ranks log a mean: divided by 2, not 4. A NaN on one rank is the max."""
    msgs = rank_messages({"v": ("max", np.array([1.0, math.nan, 3.0, 2.0]))})
    for rank, record in enumerate(msgs[:2]):
        for p in points("half", [0.5, 1.5][rank], "mean", rank):
            record.values[(p.name, p.labels)] = p.value
    got = user_values(reduce_step("u", 7, WORLD, msgs, "all_ranks").reduced)
    assert got["half"] == (1.0, "mean")
    assert math.isnan(got["v"][0]) and got["v"][1] == "max"


def test_a_name_sent_under_two_reductions_is_stored_as_mixed_without_a_value():
    msgs = rank_messages({"acc": ("max", np.array([1.0, 2.0, 3.0, 4.0]))})
    for p in points("acc", 0.5, "mean", 0):  # rank 0 declared another reduction
        msgs[0].values.pop((User.MAX, p.labels), None)
        msgs[0].values[(p.name, p.labels)] = p.value
    value, reduction = user_values(reduce_step("u", 7, WORLD, msgs, "all_ranks").reduced)["acc"]
    assert math.isnan(value) and reduction == "mixed"


def test_a_bad_name_on_the_wire_is_refused_with_the_rule():
    record = rank_messages({"ok": ("sum", np.ones(WORLD))})[0]
    record.values[(User.SUM, ((Label.NAME, "bad name"),))] = 1.0
    checked = StepValidator(Bounds()).check(record)
    assert checked.record is None and "user metric name 'bad name'" in (checked.reason or "")
