"""Semantic bounds of a rank's step, checked before anything is sized by it."""

from __future__ import annotations

import math

import pytest

from probewire.instrument.catalog import Label, Loss, Moe, System
from probewire.instrument.wire import RankStep, series_key
from probewire.stream.validate import Bounds, StepValidator


def rank_step(step=0, rank=0, world_size=4, run_id="r", values=None, coords=None) -> RankStep:
    return RankStep(
        run_id=run_id,
        step=step,
        rank=rank,
        world_size=world_size,
        host="h",
        coords=coords or {"dp": rank},
        values=values or {series_key(Loss.SUM): 3.0, series_key(Loss.TOKENS): 1.0},
    )


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (rank_step(step=-1), "step -1 outside"),
        (rank_step(step=2**62), "outside 0.."),
        (rank_step(world_size=5_000_000), "world size 5000000 outside"),
        (rank_step(rank=4), "rank 4 outside world size 4"),
        (rank_step(coords={"dp": 9}), "coordinate dp=9"),
        (rank_step(values={series_key(Loss.TOKENS): -2.0}), "count loss.tokens"),
        (rank_step(values={series_key(Loss.TOKENS): math.nan}), "count loss.tokens"),
        (rank_step(values={series_key(System.FLOPS): -1.0}), "count flops.step"),
        (
            rank_step(
                values={series_key(Moe.EXPERT_TOKENS, {Label.LAYER: "0", Label.EXPERT: "-1"}): 1.0}
            ),
            "label expert",
        ),
        (rank_step(values={series_key(Loss.SUM, {Label.SOURCE: "a|b"}): 1.0}), "'|'"),
    ],
)
def test_out_of_bounds_messages_are_refused_with_a_reason(record, reason):
    checked = StepValidator(Bounds()).check(record)
    assert checked.record is None and reason in checked.reason


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_sum_is_kept_it_is_what_a_diverging_rank_measures(value):
    """A count is refused when not finite; a loss sum is not a count: a rank whose loss went
    NaN must reach the store with it (refused, its whole message was dropped and the step
    reduced without the rank: a healthy-looking loss)."""
    values = {series_key(Loss.SUM): value, series_key(Loss.TOKENS): 4.0}
    checked = StepValidator(Bounds()).check(rank_step(values=dict(values)))
    assert checked.reason is None and checked.record.values.keys() == values.keys()
    assert (
        math.isnan(checked.record.values[series_key(Loss.SUM)])
        if math.isnan(value)
        else checked.record.values[series_key(Loss.SUM)] == value
    )


def test_ranks_that_disagree_on_world_size_are_refused():
    v = StepValidator(Bounds())
    assert v.check(rank_step(rank=0, world_size=4)).record is not None
    checked = v.check(rank_step(rank=1, world_size=8))
    assert checked.record is None and "disagrees" in checked.reason


def test_a_step_far_beyond_the_run_is_refused_but_late_steps_are_not():
    v = StepValidator(Bounds(max_step_ahead=100))
    assert v.check(rank_step(step=50)).record is not None
    assert v.check(rank_step(step=151)).record is None
    assert v.check(rank_step(step=150)).record is not None
    assert v.check(rank_step(step=0, rank=1)).record is not None  # behind: fine


def test_label_values_past_the_cap_are_dropped_and_the_rest_kept():
    v = StepValidator(Bounds(max_label_values=2))
    values = {series_key(Loss.TOKENS, {Label.SOURCE: s}): 1.0 for s in ("a", "b", "c")}
    values[series_key(System.STEP_TIME)] = 0.1
    checked = v.check(rank_step(values=values))
    assert checked.record is not None and "1 point(s) dropped" in checked.reason
    assert series_key(Loss.TOKENS, {Label.SOURCE: "c"}) not in checked.record.values
    assert series_key(System.STEP_TIME) in checked.record.values
    assert (
        v.check(rank_step(values={series_key(Loss.TOKENS, {Label.SOURCE: "a"}): 1.0})).reason
        is None
    )  # a known value stays welcome


def test_runs_are_forgotten_oldest_first():
    v = StepValidator(Bounds(max_runs=2))
    for run in ("a", "b", "c"):
        v.check(rank_step(run_id=run))
    assert v.check(rank_step(run_id="a", world_size=8)).record is not None  # forgotten


def test_label_sets_checked_once_still_meet_every_rule():
    """A label set is checked once per validator (and counted once per run): what passed
    before still passes, a refused one is refused again, counts stay per run."""
    v = StepValidator(Bounds(max_label_values=1))
    bad = {series_key(Loss.TOKENS, {Label.SOURCE: "a|b"}): 1.0}
    assert "'|'" in v.check(rank_step(values=bad)).reason
    assert "'|'" in v.check(rank_step(values=bad)).reason  # not remembered as passing
    src_a = {
        series_key(Loss.SUM, {Label.SOURCE: "a"}): 2.0,
        series_key(Loss.TOKENS, {Label.SOURCE: "a"}): 1.0,
    }
    assert v.check(rank_step(run_id="x", values=src_a)).reason is None
    # the label set passed before; the loss rule still applies to its sum
    lone_sum = {series_key(Loss.SUM, {Label.SOURCE: "a"}): 2.0}
    assert "needs its loss.tokens" in v.check(rank_step(run_id="x", values=lone_sum)).reason
    # run y counts its own values: source b fills its cap, so source a (counted in run x) is
    # over it there
    assert (
        v.check(
            rank_step(run_id="y", values={series_key(Loss.TOKENS, {Label.SOURCE: "b"}): 1.0})
        ).reason
        is None
    )
    checked = v.check(rank_step(run_id="y", values=dict(src_a)))
    assert checked.record is not None and "2 point(s) dropped" in checked.reason


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (Loss.TOKENS, 1e20),
        (Loss.TOKENS, 1e300),
        (Loss.TOKENS, float(2**64)),
        (Moe.EXPERT_TOKENS, float(2**41)),
        (System.FLOPS, 1e31),
        (System.STEP_TIME, float(2**54)),
    ],
)
def test_a_count_past_what_one_rank_measures_in_a_step_is_refused(name, value):
    """Finite, non-negative but absurd counts (which would overflow the store's UInt64
    token columns, or are no measurement) are refused with a reason naming the bound."""
    labels = {Label.LAYER: "0", Label.EXPERT: "1"} if name == Moe.EXPERT_TOKENS else {}
    values = {series_key(Loss.SUM): 3.0, series_key(Loss.TOKENS): 1.0}
    values[series_key(name, labels)] = value
    checked = StepValidator(Bounds()).check(rank_step(values=values))
    assert checked.record is None and f"count {name} must be finite and in 0.." in checked.reason


def test_counts_at_their_bound_and_negative_zero_pass():
    """The bound itself is a legal value, and -0.0 is a count of zero (not negative)."""
    values = {
        series_key(Loss.SUM): 0.0,
        series_key(Loss.TOKENS): -0.0,
        series_key(System.FLOPS): 1e30,
        series_key(System.STEP_TIME): float(2**53),
    }
    assert StepValidator(Bounds()).check(rank_step(values=values)).reason is None
    values = {series_key(Loss.SUM): 3.0, series_key(Loss.TOKENS): float(2**40)}
    assert StepValidator(Bounds()).check(rank_step(values=values)).reason is None
