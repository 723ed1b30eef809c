"""Stage 2: per-run state, fed reduced steps in step order, producing the rows to store.

The P0 row of a step is formed here from the reduced components (seeds 001 §3-§5):
L = Σ loss sums / Σ valid tokens (catalog-reduced, so tensor-parallel replicas count once), L_max = max over ranks of each rank's own mean
(ranks without a valid token skipped), G2 = sqrt(Σ over gradient shards of one replica),
τ = max over ranks of the step time, tokens = cumulative valid tokens through the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .derive import global_mean_loss, worst_rank_loss
from .records import ReducedStep, series_key

__all__ = ["RunState", "StepOrderer", "StepRow"]

_LOSS_SUM = series_key("loss.sum")
_LOSS_TOKENS = series_key("loss.tokens")
_GRAD_SQ = series_key("grad.norm_sq")
_STEP_TIME = series_key("step_time_s")


@dataclass(slots=True, kw_only=True)
class StepRow:
    """One row of ``probewire.step_metrics``: the reduced P0 series of one step."""

    run_id: str
    step: int
    tokens: int
    step_tokens: int
    loss: float | None
    loss_worst_rank: float | None
    loss_worst_rank_id: int | None
    grad_norm: float | None
    step_time_s: float | None
    ranks_reporting: int
    ranks_missing: list[int]
    complete_reason: str


@dataclass(slots=True)
class StepOrderer:
    """Releases a run's steps in increasing order.

    Stage 1 completes steps in parallel partitions, so they reach stage 2 slightly out of
    order. A step is held until its predecessor was released; a gap (a step that never
    comes, e.g. every rank's message lost) is skipped once the oldest held step has waited
    ``max_wait_s`` — longer than stage 1's deadline, so a step completed by deadline is
    still in time. The first step of a run is step 0, or, for a resumed run, the smallest
    step seen once ``max_wait_s`` has passed.
    """

    max_wait_s: float = 40.0
    next_step: int | None = None
    held: dict[int, tuple[float, ReducedStep]] = field(default_factory=dict)

    def offer(self, item: ReducedStep, now: float) -> list[ReducedStep]:
        if self.next_step is not None and item.step < self.next_step:
            return [item]  # its gap was skipped already: released as is, flagged by the caller
        self.held.setdefault(item.step, (now, item))
        if self.next_step is None and 0 in self.held:
            self.next_step = 0
        return self._release()

    def expire(self, now: float) -> list[ReducedStep]:
        """Skip gaps that held steps have waited on for longer than ``max_wait_s``."""
        out: list[ReducedStep] = []
        while self.held and now - min(t for t, _ in self.held.values()) >= self.max_wait_s:
            self.next_step = min(self.held)
            out += self._release()
        return out

    def _release(self) -> list[ReducedStep]:
        out: list[ReducedStep] = []
        while self.next_step is not None and self.next_step in self.held:
            out.append(self.held.pop(self.next_step)[1])
            self.next_step += 1
        return out


@dataclass(slots=True)
class RunState:
    """Cumulative tokens and the order of one run's steps."""

    run_id: str
    tokens: int = 0
    last_step: int = -1
    orderer: StepOrderer = field(default_factory=StepOrderer)
    written: set[int] = field(default_factory=set)

    def accept(self, reduced: ReducedStep, now: float) -> list[StepRow]:
        """Rows for the steps this arrival releases, in step order."""
        return self._rows(self.orderer.offer(reduced, now))

    def expire(self, now: float) -> list[StepRow]:
        """Rows for steps released because a gap before them timed out."""
        return self._rows(self.orderer.expire(now))

    def _rows(self, items: list[ReducedStep]) -> list[StepRow]:
        rows = []
        for item in items:
            if item.step in self.written:
                continue  # re-delivery: already counted
            if item.step < self.last_step:
                item.complete_reason = "after_gap"  # tokens are the running total at arrival
            rows.append(self._row(item))
            self.written.add(item.step)
        return rows

    def _row(self, item: ReducedStep) -> StepRow:
        ranks = sorted(item.per_rank)
        sums = [item.per_rank[r].get(_LOSS_SUM, 0.0) for r in ranks]
        counts = [item.per_rank[r].get(_LOSS_TOKENS, 0.0) for r in ranks]
        worst = worst_rank_loss(sums, counts)
        step_tokens = int(item.reduced.get(_LOSS_TOKENS, 0.0))
        self.tokens += step_tokens
        self.last_step = max(self.last_step, item.step)
        grad_sq = item.reduced.get(_GRAD_SQ)
        return StepRow(
            run_id=item.run_id, step=item.step, tokens=self.tokens, step_tokens=step_tokens,
            loss=global_mean_loss([item.reduced.get(_LOSS_SUM, 0.0)], [step_tokens]),
            loss_worst_rank=None if worst is None else worst[0],
            loss_worst_rank_id=None if worst is None else ranks[worst[1]],
            grad_norm=None if grad_sq is None else math.sqrt(grad_sq) if grad_sq >= 0 else math.nan,
            step_time_s=item.reduced.get(_STEP_TIME),
            ranks_reporting=len(item.ranks_reporting), ranks_missing=list(item.ranks_missing),
            complete_reason=item.complete_reason)
