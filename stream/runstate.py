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
    """Releases steps in increasing order; a gap is skipped once ``max_hold`` later steps wait.

    A step that never arrives (every rank lost) must not stall the run's series forever.
    """

    max_hold: int = 64
    next_step: int | None = None
    held: dict[int, ReducedStep] = field(default_factory=dict)

    def offer(self, item: ReducedStep) -> list[ReducedStep]:
        if self.next_step is not None and item.step < self.next_step:
            return [item]  # an old step arriving late: pass through, the caller dedups
        self.held[item.step] = item
        if self.next_step is None:
            self.next_step = min(self.held)
        out: list[ReducedStep] = []
        while self.held:
            if self.next_step in self.held:
                out.append(self.held.pop(self.next_step))
                self.next_step += 1
            elif len(self.held) > self.max_hold:
                self.next_step = min(self.held)
            else:
                break
        return out


@dataclass(slots=True)
class RunState:
    """Cumulative tokens and the order of one run's steps."""

    run_id: str
    tokens: int = 0
    last_step: int = -1
    orderer: StepOrderer = field(default_factory=StepOrderer)

    def accept(self, reduced: ReducedStep) -> list[StepRow]:
        return [self._row(item) for item in self.orderer.offer(reduced)
                if item.step > self.last_step]

    def _row(self, item: ReducedStep) -> StepRow:
        ranks = sorted(item.per_rank)
        sums = [item.per_rank[r].get(_LOSS_SUM, 0.0) for r in ranks]
        counts = [item.per_rank[r].get(_LOSS_TOKENS, 0.0) for r in ranks]
        worst = worst_rank_loss(sums, counts)
        step_tokens = int(item.reduced.get(_LOSS_TOKENS, 0.0))
        self.tokens += step_tokens
        self.last_step = item.step
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
