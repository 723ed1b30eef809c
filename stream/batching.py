"""Stage 2's store batch: what waits for the store, and which inputs it acknowledges.

Stage 2 turns each step message into an output (rows, steps to promote) and a new run
state. Rows are written in batches (one insert per table costs ~5 ms however small); the
step messages behind a batch are acknowledged only once its rows, its promotions and the
states of its runs are stored, in that order, so state never moves past unstored data.

A failed write goes back to the head of the queue whole, with what arrived since appended
(the retry writes both, and the state of a run after both), and is retried after a capped
exponential pause; its messages stay unacknowledged meanwhile, so a crash re-delivers
them. While ``max_backlog_steps`` messages wait, the agent stops taking more (``full``).
One batch is in flight at a time; the caller holds it between ``take`` and
``written``/``failed``. Pure: no I/O, the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from probewire.instrument.plumbing import check

from .stage2 import Stage2Output

__all__ = ["Batch", "BatchConfig", "StoreBatch"]


@dataclass(kw_only=True, slots=True)
class BatchConfig:
    """Stage 2's store batches (``stream.batch``)."""

    steps: int = 500  # write once this many step messages wait ...
    within_s: float = 0.25  # ... or this long after the oldest (alerts never wait)
    retry_max_s: float = 5.0  # longest pause between retries of a failed write
    max_backlog_steps: int = 50_000  # stop taking input while this many wait for the store

    def __post_init__(self) -> None:
        check(self.steps >= 1, "steps", "must be >= 1")
        check(0 < self.within_s <= 10, "within_s", "must lie in (0, 10]")
        check(self.retry_max_s > 0, "retry_max_s", "must be > 0")
        check(self.max_backlog_steps >= self.steps, "max_backlog_steps", "must be >= steps")


@dataclass(slots=True)
class Batch:
    """One write: per run its output and its state after it; the inputs it acknowledges."""

    outputs: dict[str, Stage2Output] = field(default_factory=dict)
    acks: list[Any] = field(default_factory=list)
    states: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    oldest_at: float | None = None

    def add(self, run_id: str, out: Stage2Output, ack: Any, now: float) -> None:
        self.outputs.setdefault(run_id, Stage2Output()).extend(out)
        if ack is not None:
            self.acks.append(ack)
        if self.oldest_at is None:
            self.oldest_at = now

    def extend(self, later: Batch) -> None:
        for run_id, out in later.outputs.items():
            self.outputs.setdefault(run_id, Stage2Output()).extend(out)
        self.acks += later.acks
        if self.oldest_at is None:
            self.oldest_at = later.oldest_at

    @property
    def steps(self) -> int:
        return sum(len(o.rows.get("step_metrics", ())) for o in self.outputs.values())


class StoreBatch:
    def __init__(self, config: BatchConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self._pending = Batch()
        self._in_flight: Batch | None = None
        self._retry_at = 0.0
        self._delay = 0.0
        self.failures = 0
        self.last_error = ""

    def add(self, run_id: str, out: Stage2Output, ack: Any = None) -> None:
        """A run's output (possibly empty: its state still changed) and the input behind it.
        Add it in the same step of the event loop as the run state changed."""
        self._pending.add(run_id, out, ack, self.clock())

    @property
    def waiting(self) -> int:
        """Inputs waiting for the store (in flight included)."""
        return len(self._pending.acks) + (len(self._in_flight.acks) if self._in_flight else 0)

    @property
    def oldest_at(self) -> float | None:
        times = [
            b.oldest_at
            for b in (self._in_flight, self._pending)
            if b is not None and b.oldest_at is not None
        ]
        return min(times) if times else None

    @property
    def full(self) -> bool:
        return self.waiting >= self.config.max_backlog_steps

    def due(self) -> bool:
        """A write should start now: something waits, nothing is in flight, no retry pause,
        and the batch is full or its oldest output waited ``within_s``."""
        p, now = self._pending, self.clock()
        if self._in_flight is not None or p.oldest_at is None or now < self._retry_at:
            return False
        return (
            len(p.acks) >= self.config.steps
            or now - p.oldest_at >= self.config.within_s
            or self.failures > 0
        )

    def take(self, snapshot: Callable[[str], tuple[int, dict[str, Any]]]) -> Batch | None:
        """Start a write: the pending batch with each run's state as it stands now (call in
        the same step of the event loop as the last ``add``). None when one is in flight or
        nothing waits."""
        if self._in_flight is not None or self._pending.oldest_at is None:
            return None
        batch, self._pending = self._pending, Batch()
        batch.states = {run_id: snapshot(run_id) for run_id in batch.outputs}
        self._in_flight = batch
        return batch

    def written(self, batch: Batch) -> list[Any]:
        """The write is durable: the inputs to acknowledge."""
        assert batch is self._in_flight
        self._in_flight, self.failures, self._delay, self.last_error = None, 0, 0.0, ""
        return batch.acks

    def failed(self, batch: Batch, error: str) -> float:
        """The write failed: it goes back to the head, to be retried after a pause (returned)."""
        assert batch is self._in_flight
        self._in_flight = None
        batch.states = {}
        batch.extend(self._pending)
        self._pending = batch
        self.failures += 1
        self.last_error = error
        self._delay = min(max(self._delay * 2, 0.1), self.config.retry_max_s)
        self._retry_at = self.clock() + self._delay
        return self._delay
