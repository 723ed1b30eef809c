"""Stage 2 ordering and the P0 row of a step."""

from __future__ import annotations

import math

import pytest

from probewire.stream.assemble import reduce_step
from probewire.stream.records import RankStep, series_key
from probewire.stream.runstate import RunState, StepOrderer

LOSS, TOK, G2 = series_key("loss.sum"), series_key("loss.tokens"), series_key("grad.norm_sq")


def reduced(step: int, per_rank: dict[int, tuple[float, float]], g2: float = 4.0):
    records = [RankStep(run_id="r", step=step, rank=r, world_size=len(per_rank), host="h",
                        coords={"dp": r}, values={LOSS: s, TOK: n, G2: g2})
               for r, (s, n) in per_rank.items()]
    return reduce_step("r", step, len(per_rank), records, "all_ranks")


def test_row_uses_token_weighted_loss_and_skips_empty_rank_in_worst():
    state = RunState("r")
    (row,) = state.accept(reduced(0, {0: (30.0, 10.0), 1: (0.0, 0.0), 2: (8.0, 2.0)}), now=0)
    assert row.loss == pytest.approx(38.0 / 12.0)
    assert row.loss_worst_rank == pytest.approx(4.0) and row.loss_worst_rank_id == 2
    assert row.grad_norm == pytest.approx(2.0) and row.tokens == 12 and row.step_tokens == 12


def test_out_of_order_steps_are_released_in_order_with_cumulative_tokens():
    state = RunState("r")
    assert state.accept(reduced(1, {0: (1.0, 5.0)}), now=0) == []
    rows = state.accept(reduced(0, {0: (1.0, 3.0)}), now=0)
    assert [(r.step, r.tokens) for r in rows] == [(0, 3), (1, 8)]
    assert state.accept(reduced(1, {0: (1.0, 5.0)}), now=1) == []  # re-delivery


def test_gap_is_skipped_after_max_wait_and_late_step_still_written():
    state = RunState("r", orderer=StepOrderer(max_wait_s=10))
    state.accept(reduced(0, {0: (1.0, 1.0)}), now=0)
    assert state.accept(reduced(2, {0: (1.0, 1.0)}), now=1) == []
    assert state.expire(now=10.9) == []
    assert [r.step for r in state.expire(now=11)] == [2]
    (late,) = state.accept(reduced(1, {0: (1.0, 1.0)}), now=12)
    assert late.step == 1 and late.complete_reason == "after_gap"


def test_resumed_run_starts_at_its_first_step_after_max_wait():
    orderer = StepOrderer(max_wait_s=5)
    assert orderer.offer(reduced(101, {0: (1.0, 1.0)}), now=0) == []
    assert orderer.offer(reduced(100, {0: (1.0, 1.0)}), now=1) == []
    assert [i.step for i in orderer.expire(now=5)] == [100, 101]


def test_negative_squared_norm_is_not_silently_a_number():
    state = RunState("r")
    (row,) = state.accept(reduced(0, {0: (1.0, 1.0)}, g2=math.nan), now=0)
    assert math.isnan(row.grad_norm)
