"""Tests for probewire.evaluators.cadence: evaluation follows tokens, not wall time."""

from __future__ import annotations

import pytest

from probewire.evaluators.cadence import Cadence, RunProgress, decide, progress_mark


def _evaluated(cadence: Cadence, tokens: list[int], **kwargs: object) -> list[bool]:
    return [cadence.decide("run", tokens=t, **kwargs).evaluate for t in tokens]


def test_every_one_percent_of_planned_tokens() -> None:
    cadence = Cadence(every_fraction=0.01)
    # plan 1000 tokens: marks at 10, 20, 30, ...
    got = _evaluated(cadence, [5, 10, 15, 19, 20, 35, 36], planned_tokens=1000)
    assert got == [False, True, False, False, True, True, False]


def test_a_jump_over_several_marks_evaluates_once() -> None:
    cadence = Cadence(every_fraction=0.01)
    decision = cadence.decide("run", tokens=57, planned_tokens=1000)
    assert decision.evaluate and decision.reason == "crossed 5% of plan"
    assert not cadence.decide("run", tokens=59).evaluate


@pytest.mark.parametrize(
    ("tokens", "plan", "fraction", "mark"),
    [
        (7, 100, 0.07, 1),
        (6, 100, 0.07, 0),
        (10_000, 10**6, 0.01, 1),
        (9_999, 10**6, 0.01, 0),
        (10**15, 10**15, 0.005, 200),
    ],
)
def test_marks_are_exact(tokens: int, plan: int, fraction: float, mark: int) -> None:
    """0.07 × 100 is 7.000000000000001 in floats; the mark at 7 tokens must still count."""
    assert progress_mark(tokens, plan, fraction) == mark


def test_key_checkpoints_are_always_evaluated_but_not_twice() -> None:
    cadence = Cadence(every_fraction=0.02)
    assert not cadence.decide("run", tokens=11, planned_tokens=1000).evaluate
    key = cadence.decide("run", tokens=12, key=True)
    assert key.evaluate and key.reason == "key checkpoint"
    assert not cadence.decide("run", tokens=12, key=True).evaluate  # redelivered
    # a key checkpoint behind the front still counts (it was marked on purpose)
    assert cadence.decide("run", tokens=5, key=True).evaluate


def test_non_monotone_tokens_do_not_re_evaluate_covered_progress() -> None:
    cadence = Cadence(every_fraction=0.01)
    got = _evaluated(cadence, [30, 20, 25, 31, 39, 40, 12], planned_tokens=1000)
    # 30: mark 3. 20, 25: behind the front. 31, 39: no new mark. 40: mark 4. 12: behind.
    assert got == [True, False, False, False, False, True, False]
    assert cadence.runs["run"].front_tokens == 40


def test_runs_are_independent() -> None:
    cadence = Cadence(every_fraction=0.01)
    assert cadence.decide("a", tokens=10, planned_tokens=1000).evaluate
    assert cadence.decide("b", tokens=10, planned_tokens=1000).evaluate
    assert not cadence.decide("a", tokens=15).evaluate


def test_without_a_plan_every_advancing_checkpoint_counts() -> None:
    cadence = Cadence()
    got = _evaluated(cadence, [1, 2, 2, 1, 3])
    assert got == [True, True, False, False, True]
    reason = cadence.decide("run", tokens=4).reason
    assert reason == "no planned_tokens: every new checkpoint counts"


def test_a_plan_announced_once_is_remembered_and_can_change() -> None:
    cadence = Cadence(every_fraction=0.01)
    assert cadence.decide("run", tokens=10, planned_tokens=1000).evaluate
    assert not cadence.decide("run", tokens=15).evaluate  # plan remembered: next mark at 20
    # the plan doubles: marks every 20 tokens; front 15 -> mark 0, 25 -> mark 1
    assert cadence.decide("run", tokens=25, planned_tokens=2000).evaluate
    assert not cadence.decide("run", tokens=39).evaluate
    assert cadence.decide("run", tokens=40).evaluate


def test_decide_is_pure() -> None:
    state = RunProgress(front_tokens=10, planned_tokens=100, last_evaluated_tokens=10)
    decision, new = decide(state, tokens=21, key=False, planned_tokens=None, every_fraction=0.1)
    assert decision.evaluate
    assert state == RunProgress(front_tokens=10, planned_tokens=100, last_evaluated_tokens=10)
    assert new == RunProgress(front_tokens=21, planned_tokens=100, last_evaluated_tokens=21)


@pytest.mark.parametrize("fraction", [0.0, -0.01, 1.5])
def test_bad_fraction_is_rejected(fraction: float) -> None:
    with pytest.raises(ValueError, match="every_fraction"):
        Cadence(every_fraction=fraction)
