"""Persistent shifts of one member against its peers: a one-sided CUSUM per key (seeds 001
§4 asks for each group to be compared against its own history; a spike detector sees a
move once, a CUSUM sees a move that stays).

Pure and serialisable (``to_state``/``from_state``), like ``detect``. Each key (a rank) has
a ratio r_t > 0 against its peers at every step it is measured (its own time over the
other ranks' median; its own loss over the other ranks' median). On log values:

* x_t = log r_t - b, with b the median of the key's own history (the ``window`` values
  before this one; with ``delay`` d, the ``window`` values before the last d: a value joins
  the history d steps after it was scored, so a shift that stays is scored against the
  baseline and spread from before it for d steps instead of widening them at once), at
  least log ``floor`` when a floor is set (parity for own time: a rank that is usually
  faster than the others is judged against parity);
* s_t = max(``min_scale``, 1.4826 MAD of the key's history, the root mean square of the
  other keys' positive deviations max(x, 0) over their last ``joint_steps`` values): the
  rank's own spread and the ranks' joint one of the last steps, so load that slows every
  rank in bursts (a CPU burner) widens the scale at once, while one slow rank among
  steady peers does not (they sit at or below their baselines: it is in their reference);
* y_t = min(x_t / s_t, ``cap``) - ``k``: a step counts by at most ``cap`` scales (one
  outlier is the spike detectors' business), minus the allowance ``k``;
* S_t = 0 when x_t <= 0 (a step at or below its baseline: the key was not slower, not
  worse, on it), else max(0, S_{t-1} + y_t). S_t >= ``h`` is a shift: reported, and S is
  reset to 0 (a shift that stays is found again ``h`` / y steps later).

A shift of d log units on a quiet key (s = ``min_scale``) gains min(d/s, cap) - k per step:
with k = 2, cap = 4, h = 16 (the defaults here) and s = 0.01 (the loss shift's) a rank's loss
10 % up pages on its 8th step, and any move must hold on h / (cap - k) = 8 steps in a row
with no step at parity; the straggler's (k = 1, cap = 3, h = 12) page a rank 1.3x slower
on its 6th. Under bursts every rank shares the joint scale rises with them.
With fewer than 3 keys nothing is scored (two ranks: each is the other's whole reference).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .packed import pack, unpack
from .rolling import sorted_median, sorted_median_mad

__all__ = ["MAD_SIGMA", "PeerShift", "ShiftResult"]

MAD_SIGMA = 1.4826
"""Scales a median absolute deviation to a normal standard deviation."""


@dataclass(frozen=True, slots=True)
class ShiftResult:
    """One key at one step: its ratio, baseline exp(b), scale s, CUSUM S after the step,
    and ``shift`` when S reached h (S is then reset)."""

    key: int
    ratio: float
    baseline: float
    scale: float
    score: float
    shift: bool


@dataclass(kw_only=True, slots=True)
class PeerShift:
    """One-sided CUSUM per key on log ratios against the key's own history (module doc)."""

    window: int = 100
    min_history: int = 20
    k: float = 2.0
    cap: float = 4.0
    h: float = 16.0
    min_scale: float = 0.05
    floor: float | None = None
    joint_steps: int = 10
    delay: int = 0
    _history: dict[int, deque[float]] = field(init=False, repr=False, compare=False)
    _sorted: dict[int, list[float]] = field(init=False, repr=False, compare=False)
    _recent: dict[int, deque[float]] = field(init=False, repr=False, compare=False)
    _score: dict[int, float] = field(init=False, repr=False, compare=False)
    _latest: dict[int, bool] = field(init=False, repr=False, compare=False)
    _pending: dict[int, deque[float]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 3 <= self.min_history <= self.window:
            raise ValueError(
                f"min_history must be in [3, window={self.window}], got {self.min_history!r}"
            )
        for name in ("k", "cap", "h", "min_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if self.cap <= self.k:
            raise ValueError(f"cap ({self.cap}) must exceed k ({self.k}): nothing could add up")
        if self.joint_steps < 1:
            raise ValueError(f"joint_steps must be >= 1, got {self.joint_steps!r}")
        if self.delay < 0:
            raise ValueError(f"delay must be >= 0, got {self.delay!r}")
        self._history, self._sorted, self._recent, self._score = {}, {}, {}, {}
        self._pending = {}  # key -> its last ``delay`` values, not yet in its history
        self._latest = {}  # key -> scored at the latest update

    def baseline(self, key: int) -> float | None:
        """b of the key (log units), None while its history is shorter than min_history."""
        ordered = self._sorted.get(key)
        if ordered is None or len(ordered) < self.min_history:
            return None
        b = sorted_median(ordered)
        return b if self.floor is None else max(b, math.log(self.floor))

    def held(self, key: int, steps: int) -> float | None:
        """exp(min x) over the key's last ``steps`` scored values: the ratio to its baseline
        it held on each of them; None while it has fewer (or none at the latest update)."""
        recent = self._recent.get(key)
        if recent is None or len(recent) < steps or not self._latest.get(key, False):
            return None
        return math.exp(min(list(recent)[-steps:]))

    def _joint_scales(self) -> dict[int, float]:
        """Per key: the root mean square of the positive deviations max(x, 0) over the other
        keys' last ``joint_steps`` values (0: none). Ranks slowed in bursts by load they
        share are slower than their baselines together; a straggler's peers are not (they
        sit at or below theirs: the straggler is in their reference)."""
        sums = {k: (sum(max(x, 0.0) ** 2 for x in r), len(r)) for k, r in self._recent.items()}
        total = sum(q for q, _ in sums.values()), sum(n for _, n in sums.values())
        out = {}
        for key, (q, n) in sums.items():
            rest = total[1] - n
            out[key] = math.sqrt(max(total[0] - q, 0.0) / rest) if rest else 0.0
        return out

    def update(self, ratios: Mapping[int, float]) -> list[ShiftResult]:
        """Score one step's ratios (finite, > 0; others are not measurements) against each
        key's history, then add them to it. Keys in warm-up give no result; with fewer than
        3 keys scored nothing is (two keys: which one moved is not known)."""
        scored: dict[int, tuple[float, float, float]] = {}  # key -> (u, x, own scale)
        self._latest = dict.fromkeys(self._latest, False)
        for key, r in ratios.items():
            if not (math.isfinite(r) and r > 0):
                continue
            u = math.log(r)
            b = self.baseline(key)
            if b is not None:
                own = MAD_SIGMA * sorted_median_mad(self._sorted[key])[1]
                self._recent.setdefault(key, deque(maxlen=self.joint_steps)).append(u - b)
                scored[key] = (u, u - b, own)
                self._latest[key] = True
            self._delayed(key, u)
        if len(scored) < 3:
            return []
        joint = self._joint_scales()
        out = []
        for key, (u, x, own) in sorted(scored.items()):
            scale = max(self.min_scale, own, joint.get(key, 0.0))
            gain = min(x / scale, self.cap) - self.k
            score = 0.0 if x <= 0 else max(0.0, self._score.get(key, 0.0) + gain)
            shift = score >= self.h
            self._score[key] = 0.0 if shift else score
            out.append(ShiftResult(key, math.exp(u), math.exp(u - x), scale, score, shift))
        return out

    def _delayed(self, key: int, u: float) -> None:
        """``u`` into the key's history ``delay`` values later."""
        if not self.delay:
            self._add(key, u)
            return
        pending = self._pending.setdefault(key, deque())
        pending.append(u)
        if len(pending) > self.delay:
            self._add(key, pending.popleft())

    def _add(self, key: int, u: float) -> None:
        history = self._history.get(key)
        if history is None:
            history = self._history[key] = deque(maxlen=self.window)
            self._sorted[key] = []
        ordered = self._sorted[key]
        if len(history) == self.window:
            del ordered[bisect_left(ordered, history[0])]
        history.append(u)
        insort(ordered, u)

    def to_state(self) -> dict[str, Any]:
        keys = sorted(self._history.keys() | self._pending.keys())
        return {
            "config": {
                "window": self.window,
                "min_history": self.min_history,
                "k": self.k,
                "cap": self.cap,
                "h": self.h,
                "min_scale": self.min_scale,
                "floor": self.floor,
                "joint_steps": self.joint_steps,
                "delay": self.delay,
            },
            "packed": {  # ``packed``: JSON lists of every key's floats cost 0.1 s a step
                "keys": keys,
                "score": [self._score.get(key, 0.0) for key in keys],
                "latest": [self._latest.get(key, False) for key in keys],
                "history": pack([self._history.get(key, ()) for key in keys]),
                "recent": pack([self._recent.get(key, ()) for key in keys]),
                "pending": pack([self._pending.get(key, ()) for key in keys]),
            },
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> PeerShift:
        shift = cls(**state["config"])
        if "packed" in state:
            p = state["packed"]
            names = ("history", "recent", "pending")
            keys = [
                dict(zip(names, values), key=key, score=score, latest=latest)
                for key, score, latest, *values in zip(
                    p["keys"], p["score"], p["latest"], *(unpack(p[n]) for n in names), strict=True
                )
            ]
        else:  # saved as JSON lists, before ``packed``
            keys = [dict(saved, key=key) for key, saved in state["keys"].items()]
        for saved in keys:
            key = int(saved["key"])
            for u in saved["history"]:
                shift._add(key, float(u))
            if saved.get("pending"):  # absent: saved before the delay
                shift._pending[key] = deque(float(u) for u in saved["pending"])
            if saved["recent"]:
                shift._recent[key] = deque(
                    (float(x) for x in saved["recent"]), maxlen=shift.joint_steps
                )
            shift._score[key] = float(saved["score"])
            shift._latest[key] = bool(saved.get("latest", False))
        return shift
