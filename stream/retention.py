"""Which steps keep their detailed payloads (seeds 001 §12).

The reduced P0 series is always stored; this module only decides which steps also
keep per-rank raw values and P1/P2 detail. A step s of a run with steps 0..n-1 is
kept when any of these holds:

- s % k == 0 (the sampling interval K),
- s < warmup_steps (warm-up),
- s >= n - final_steps (the end of the run),
- |s - a| <= halo for some anomaly step a (the anomaly itself and its halo).

``retained_steps`` states the rule in closed form; ``RetentionPolicy`` applies it
online with a bounded look-back buffer, because a detector cannot recover detail
from before the event that fired it.

Steps that come out of order are kept, never refused: a step at or below the newest
one (it arrived after stage 2 skipped its gap) is released at once by ``offer_late``,
because its detail is the evidence of why it was late. A run that finished (it was idle
for ``run_idle_s``) and then sends another step is reopened: ``finish`` released the
final steps of the segment before the pause, and the policy goes on from there.
``finish`` is idempotent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["RetentionPolicy", "retained_steps"]

P = TypeVar("P")


def _check_config(k: int, halo: int, warmup_steps: int, final_steps: int) -> None:
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k!r}")
    named = (("halo", halo), ("warmup_steps", warmup_steps), ("final_steps", final_steps))
    for name, value in named:
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")


def retained_steps(
    n_steps: int,
    anomalies: Iterable[int],
    k: int,
    halo: int = 100,
    warmup_steps: int = 0,
    final_steps: int = 0,
) -> set[int]:
    """The steps of a run of ``n_steps`` (0..n_steps-1) that keep detail, in closed form."""
    _check_config(k, halo, warmup_steps, final_steps)
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0, got {n_steps!r}")
    kept = {s for s in range(n_steps) if s % k == 0 or s < warmup_steps}
    kept.update(range(max(0, n_steps - final_steps), n_steps))
    for a in anomalies:
        if not 0 <= a < n_steps:
            raise ValueError(f"anomaly step {a!r} is outside 0..{n_steps - 1}")
        kept.update(range(max(0, a - halo), min(n_steps, a + halo + 1)))
    return kept


@dataclass(kw_only=True, slots=True)
class RetentionPolicy(Generic[P]):
    """Online form of ``retained_steps`` for steps offered in increasing order.

    A step that is kept when offered (sampled, warm-up, anomaly, or inside the
    forward hold of an earlier anomaly) is released at once. Any other step waits
    in a look-back buffer holding the steps within max(halo, final_steps) of the
    newest one: an anomaly releases the buffered steps within ``halo`` before it,
    ``finish()`` releases those among the final ``final_steps``, and older steps
    are dropped. The forward hold is kept as the last step it covers
    (``hold_until``), which stays right when step numbers have gaps; the run's end
    is the last offered step. Every step is released at most once and each returned
    list is in step order; a look-back release can hold steps older than one
    released by an earlier call (a sampled step is persisted at once, not held).
    State is plain JSON types when the payloads are.
    """

    k: int
    halo: int = 100
    warmup_steps: int = 0
    final_steps: int = 0
    _buffer: deque[tuple[int, P]] = field(init=False, repr=False, compare=False)
    _last_step: int | None = field(init=False, repr=False, compare=False)
    _hold_until: int | None = field(init=False, repr=False, compare=False)
    _finished: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_config(self.k, self.halo, self.warmup_steps, self.final_steps)
        self._buffer = deque()
        self._last_step = None
        self._hold_until = None
        self._finished = False

    @property
    def lookback(self) -> int:
        """How many steps back the buffer reaches: max(halo, final_steps)."""
        return max(self.halo, self.final_steps)

    def offer(self, step: int, payload: P, anomaly: bool) -> list[tuple[int, P]]:
        """Take one step's detail; return the (step, payload) pairs to persist now.

        A step at or below the newest offered one goes to ``offer_late``; a step after
        ``finish`` reopens the run (see the module docstring). Never raises on a step."""
        self._finished = False
        if self._last_step is not None and step <= self._last_step:
            return self.offer_late(step, payload)
        self._last_step = step
        released: list[tuple[int, P]] = []
        if anomaly:
            self._hold_until = step + self.halo
            # Buffered steps are increasing: release the tail inside the halo, keep the
            # older ones, which may still turn out to be final steps.
            while self._buffer and self._buffer[-1][0] >= step - self.halo:
                released.append(self._buffer.pop())
            released.reverse()
        keep = (
            anomaly
            or step % self.k == 0
            or step < self.warmup_steps
            or (self._hold_until is not None and step <= self._hold_until)
        )
        if keep:
            released.append((step, payload))
        else:
            self._buffer.append((step, payload))
        oldest = step + 1 - self.lookback
        while self._buffer and self._buffer[0][0] < oldest:
            self._buffer.popleft()
        return released

    def offer_late(self, step: int, payload: P) -> list[tuple[int, P]]:
        """A step that arrived after newer ones: kept (released at once); the buffer, the
        hold and the newest step are unchanged."""
        self._finished = False
        return [(step, payload)]

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self) -> list[tuple[int, P]]:
        """Signal the run's end; release the buffered steps among the final ``final_steps``.
        A second call (no step since) releases nothing."""
        if self._finished:
            return []
        self._finished = True
        released: list[tuple[int, P]] = []
        if self._last_step is not None:
            first_final = self._last_step + 1 - self.final_steps
            released = [item for item in self._buffer if item[0] >= first_final]
        self._buffer.clear()
        return released

    def to_state(self) -> dict[str, object]:
        """Configuration, buffer and hold as plain types (payloads stored as given)."""
        return {
            "k": self.k,
            "halo": self.halo,
            "warmup_steps": self.warmup_steps,
            "final_steps": self.final_steps,
            "last_step": self._last_step,
            "hold_until": self._hold_until,
            "finished": self._finished,
            "buffer": [[step, payload] for step, payload in self._buffer],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RetentionPolicy[P]:
        """Rebuild a policy from ``to_state()`` output (lists or tuples in ``buffer``)."""
        policy: RetentionPolicy[P] = cls(
            k=int(state["k"]),
            halo=int(state["halo"]),
            warmup_steps=int(state["warmup_steps"]),
            final_steps=int(state["final_steps"]),
        )
        last, hold = state["last_step"], state["hold_until"]
        policy._last_step = None if last is None else int(last)
        policy._hold_until = None if hold is None else int(hold)
        policy._finished = bool(state["finished"])
        steps = [int(step) for step, _ in state["buffer"]]
        if steps and (policy._last_step is None or steps[-1] > policy._last_step):
            raise ValueError("buffer steps must not come after last_step")
        if steps != sorted(set(steps)):
            raise ValueError("buffer steps must be strictly increasing")
        policy._buffer.extend((int(step), payload) for step, payload in state["buffer"])
        return policy
