"""When to evaluate: by training progress (tokens), never by wall time (seeds 001 §10).

A run is evaluated each time its cumulative tokens cross another multiple of
``every_fraction`` × planned tokens (default 1%), and at every checkpoint marked key.
The marks are computed in exact integer arithmetic, so 1% of 10⁶ tokens is crossed at
exactly 10 000 tokens.

Rules, in order, for one checkpoint of a run:

1. A checkpoint whose tokens equal the last evaluated checkpoint's is a redelivery:
   skipped (at-least-once delivery must not double the evaluations).
2. ``key`` → evaluate.
3. Tokens not beyond the furthest checkpoint seen for the run → skip. Out-of-order
   announcements and a run resumed from an earlier checkpoint do not re-evaluate
   progress already covered; evaluation resumes once the run passes its old front.
4. No planned tokens known for the run (none on this event nor an earlier one) →
   evaluate every checkpoint that advances the front: without a plan there are no marks.
5. Evaluate when ⌊tokens / interval⌋ > ⌊front / interval⌋, interval = fraction × plan.

The newest ``planned_tokens`` announced wins, so an extended plan moves the marks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

__all__ = ["Cadence", "CadenceDecision", "RunProgress", "decide", "progress_mark"]


def _fraction(every_fraction: float) -> Fraction:
    frac = Fraction(repr(float(every_fraction)))  # 0.01 -> 1/100 exactly
    if not 0 < frac <= 1:
        raise ValueError(f"every_fraction must lie in (0, 1], got {every_fraction!r}")
    return frac


def progress_mark(tokens: int, planned_tokens: int, every_fraction: float) -> int:
    """⌊tokens / (every_fraction × planned_tokens)⌋: how many marks ``tokens`` has passed."""
    if tokens < 0 or planned_tokens <= 0:
        raise ValueError(f"need tokens >= 0 and planned_tokens > 0, got {tokens}, {planned_tokens}")
    frac = _fraction(every_fraction)
    return (tokens * frac.denominator) // (planned_tokens * frac.numerator)


@dataclass(kw_only=True, slots=True, frozen=True)
class RunProgress:
    """What the cadence remembers about one run."""

    front_tokens: int = 0  # furthest tokens announced so far
    planned_tokens: int | None = None  # newest plan announced
    last_evaluated_tokens: int | None = None


@dataclass(kw_only=True, slots=True, frozen=True)
class CadenceDecision:
    evaluate: bool
    reason: str


def decide(
    state: RunProgress, *, tokens: int, key: bool, planned_tokens: int | None, every_fraction: float
) -> tuple[CadenceDecision, RunProgress]:
    """Apply the module's rules to one checkpoint; return the decision and the new state."""
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    plan = planned_tokens if planned_tokens is not None else state.planned_tokens
    front = state.front_tokens
    new_state = replace(state, front_tokens=max(front, tokens), planned_tokens=plan)
    if tokens == state.last_evaluated_tokens:
        return CadenceDecision(
            evaluate=False, reason=f"already evaluated at {tokens} tokens"
        ), new_state
    if key:
        decision = CadenceDecision(evaluate=True, reason="key checkpoint")
    elif tokens <= front:
        decision = CadenceDecision(
            evaluate=False, reason=f"{tokens} tokens not beyond the run's front ({front})"
        )
    elif plan is None:
        decision = CadenceDecision(
            evaluate=True, reason="no planned_tokens: every new checkpoint counts"
        )
    else:
        before = progress_mark(front, plan, every_fraction)
        after = progress_mark(tokens, plan, every_fraction)
        if after > before:
            pct = float(_fraction(every_fraction) * after * 100)
            decision = CadenceDecision(evaluate=True, reason=f"crossed {pct:g}% of plan")
        else:
            decision = CadenceDecision(
                evaluate=False, reason=f"no new {every_fraction:g} mark of plan"
            )
    if decision.evaluate:
        new_state = replace(new_state, last_evaluated_tokens=tokens)
    return decision, new_state


@dataclass(slots=True)
class Cadence:
    """Per-run cadence state around ``decide`` (in memory; a restart starts afresh, which
    costs at most one extra evaluation per run)."""

    every_fraction: float = 0.01
    runs: dict[str, RunProgress] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _fraction(self.every_fraction)

    def decide(
        self, run_id: str, *, tokens: int, key: bool = False, planned_tokens: int | None = None
    ) -> CadenceDecision:
        decision, self.runs[run_id] = decide(
            self.runs.get(run_id, RunProgress()),
            tokens=tokens,
            key=key,
            planned_tokens=planned_tokens,
            every_fraction=self.every_fraction,
        )
        return decision
