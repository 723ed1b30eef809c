"""Stage 2's step order: a run's reduced steps are processed in increasing step order."""

from __future__ import annotations

import base64
import bisect
from dataclasses import dataclass, field
from typing import Any

from .records import ReducedStep

__all__ = ["SkippedSteps", "StepOrderer"]


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
    # held steps as saved (``to_state``), each encoded once: a run catching up on a backlog
    # holds hundreds, and its state is saved with every store batch
    _saved: dict[int, str] = field(default_factory=dict, repr=False, compare=False)

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
            self._saved.pop(self.next_step, None)
            self.next_step += 1
        return out

    def to_state(self) -> dict[str, Any]:
        saved = self._saved
        for step, (_, item) in self.held.items():
            if step not in saved:
                saved[step] = base64.b64encode(item.to_bytes()).decode()
        return {"next_step": self.next_step, "held": [saved[step] for step in self.held]}

    @classmethod
    def from_state(cls, state: dict[str, Any], max_wait_s: float, now: float) -> StepOrderer:
        """Held steps restart their wait at ``now``."""
        held = [ReducedStep.from_bytes(base64.b64decode(text)) for text in state["held"]]
        return cls(max_wait_s, state["next_step"], {i.step: (now, i) for i in held})


class SkippedSteps:
    """The steps a gap skip passed over (they may still arrive), as at most ``max_ranges``
    closed ranges: memory is bounded by the number of gaps, never by a step number.

    When more gaps than ``max_ranges`` are open, the oldest range is forgotten (counted in
    ``forgotten``): a step of it that still arrives is then taken for a re-delivery."""

    def __init__(
        self, ranges: list[tuple[int, int]] | None = None, max_ranges: int = 10_000
    ) -> None:
        self.max_ranges = max_ranges
        self._ranges: list[list[int]] = sorted([int(a), int(b)] for a, b in ranges or [])
        self.forgotten = 0

    def __contains__(self, step: int) -> bool:
        i = bisect.bisect_right(self._ranges, [step, float("inf")]) - 1
        return i >= 0 and self._ranges[i][0] <= step <= self._ranges[i][1]

    def __len__(self) -> int:
        return len(self._ranges)

    def add(self, first: int, last: int) -> None:
        """Steps ``first..last`` (inclusive) were skipped; nothing when ``first > last``."""
        if first > last:
            return
        bisect.insort(self._ranges, [first, last])
        while len(self._ranges) > self.max_ranges:
            self._ranges.pop(0)
            self.forgotten += 1

    def discard(self, step: int) -> None:
        """``step`` arrived: it is no longer skipped."""
        i = bisect.bisect_right(self._ranges, [step, float("inf")]) - 1
        if i < 0 or not self._ranges[i][0] <= step <= self._ranges[i][1]:
            return
        first, last = self._ranges.pop(i)
        for part in ([step + 1, last], [first, step - 1]):
            if part[0] <= part[1]:
                self._ranges.insert(i, part)

    def to_state(self) -> list[list[int]]:
        return [list(r) for r in self._ranges]
