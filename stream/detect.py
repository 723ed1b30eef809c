"""Spike detectors for scalar training signals (seeds 001 §4).

Pure, incremental and serialisable: no Faust, no Kafka, no I/O. Each class keeps
only what the next update needs and can be written to plain JSON types with
``to_state()`` and rebuilt with ``from_state()``, so a restarted worker carries
on with identical results.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import itemgetter
from typing import Any

import numpy as np

from .packed import pack, pairs, unpack, unpairs
from .rolling import sorted_median, sorted_median_mad, sorted_quantile

_VALUE = itemgetter(1)  # u of a (step, u) pair

__all__ = [
    "MIN_SPREAD",
    "ClipRateResult",
    "ClipRateWindow",
    "CoSpikeResult",
    "CoSpikeTracker",
    "RobustSpikeDetector",
    "SpikeResult",
    "RankLevels",
    "pack_detectors",
    "unpack_detectors",
    "calibrate",
    "median_mad",
    "robust_z",
    "spread_floor",
    "trend_median_mad",
]

MAD_TO_SIGMA = 0.6745
"""Scales a median absolute deviation to a normal standard deviation (seeds 001 §4)."""

MIN_SPREAD = 1e-3
"""The smallest spread a robust score divides by, relative to the level: on log values a
spread of 1e-3 is a 0.1% move. A window with no spread at all (a constant series, a
peak-memory high-water mark) scores a move in these units instead of dividing by ~0 (the
old eps of 1e-8 turned a 5% step of a constant series into z ~ 3e6)."""


def median_mad(values: np.ndarray) -> tuple[float, float]:
    """q = median(values) and D = median |values - q|, in float64 (seeds 001 §4)."""
    values = np.asarray(values, dtype=np.float64)
    q = float(np.median(values))
    return q, float(np.median(np.abs(values - q)))


def trend_median_mad(values: Sequence[float]) -> tuple[float, float]:
    """The early regime's baseline of ``values`` (in arrival order, n >= 2) carried to the
    next index n, and its spread: slope b = (median of the last n // 2 values - median of
    the first n // 2) / (n - n // 2), the distance between the halves' centres (the middle
    value is left out when n is odd); residuals r_i = values_i - b i; q = median(r) + b n,
    D = median |r - median(r)|. A robust line in O(n log n), exact on a straight line; a
    window without a trend gives b ~ 0, the plain median and MAD."""
    n = len(values)
    half = n // 2
    ordered_first = sorted(values[:half])
    ordered_last = sorted(values[n - half :])
    slope = (sorted_median(ordered_last) - sorted_median(ordered_first)) / (n - half)
    residuals = sorted(v - slope * i for i, v in enumerate(values))
    level, spread = sorted_median_mad(residuals)
    return level + slope * n, spread


def spread_floor(level: float, *, log: bool, min_spread: float = MIN_SPREAD) -> float:
    """The floor under D, relative to the level: ``min_spread`` on log values (already a
    relative scale); ``min_spread`` x |level| (at least ``min_spread``) on linear values."""
    return min_spread if log else min_spread * max(abs(level), 1.0)


def robust_z(deviation: float, mad: float, floor: float) -> float:
    """z = 0.6745 (u - q) / max(D, floor): the robust spike score of seeds 001 §4 with the
    spread floored (signed: negative below the median). The one formula the stream's
    detectors and ``probewire explain`` share."""
    return MAD_TO_SIGMA * deviation / max(mad, floor)


def _positive_finite(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class SpikeResult:
    """One detector update.

    ``median`` and ``mad`` are q_t and D_t of the window *before* this value;
    they, ``z`` and ``u`` are None when not defined (warm-up, non-finite input).
    ``direction`` is the sign of u_t - q_t (+1, -1 or 0); for a non-finite input
    it is +1 for +inf, -1 for -inf or x <= -eps, 0 for NaN.
    """

    x: float
    u: float | None
    median: float | None
    mad: float | None
    z: float | None
    direction: int
    spike: bool
    warmup: bool
    nonfinite: bool


@dataclass(kw_only=True, slots=True)
class RobustSpikeDetector:
    """Rolling median/MAD spike score on log-values (seeds 001 §4).

    u_t = log(x_t + eps); q_t = median(W_t); D_t = median_{u in W_t} |u - q_t|;
    z_t = 0.6745 |u_t - q_t| / max(D_t, min_spread), where W_t holds the previous
    ``window`` finite u-values (u_t itself is not in its own window).

    A step is a spike when u_t > q_t and z_t > threshold: only upward moves page,
    because a falling loss or gradient norm is not an instability; the signed
    ``direction`` is still reported. With fewer than ``min_history`` values the
    result is warm-up (z None, no spike), except in the early regime: with
    ``early_history`` set, a value is scored once the window holds that many values, against
    ``early_threshold`` (wider than ``threshold``: a short window's median and MAD are
    rough) until it holds ``min_history``, and against the window's trend
    (``trend_median_mad``: a run's first steps fall fast, and the spread of a falling window
    would hide a spike); such a result is still ``warmup`` (the window is not full) but has
    its z and can be a spike. A constant window has D_t = 0: a change scores
    against the floor ``min_spread`` (relative to the level, see ``MIN_SPREAD``), so a 1%
    move of a constant series is z ~ 6.7, not millions; an identical value scores 0.
    NaN, +-inf and x <= -eps (log undefined) are reported as spikes with
    ``nonfinite=True`` and are not added to the window; finite values, spikes
    included, are.
    """

    window: int = 100
    min_history: int | None = None
    threshold: float = 6.0
    eps: float = 1e-8
    min_spread: float = MIN_SPREAD
    early_history: int | None = None
    early_threshold: float | None = None
    _history: deque[float] = field(init=False, repr=False, compare=False)
    _sorted: list[float] = field(init=False, repr=False, compare=False)  # _history, ascending

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError(f"window must be >= 3, got {self.window!r}")
        if self.min_history is None:
            self.min_history = self.window
        if not 3 <= self.min_history <= self.window:
            raise ValueError(
                f"min_history must be in [3, window={self.window}], got {self.min_history!r}"
            )
        _positive_finite("threshold", self.threshold)
        _positive_finite("eps", self.eps)
        _positive_finite("min_spread", self.min_spread)
        if self.early_history is not None:
            if not 3 <= self.early_history <= self.min_history:
                raise ValueError(
                    f"early_history must be in [3, min_history={self.min_history}], "
                    f"got {self.early_history!r}"
                )
            if self.early_threshold is None:
                raise ValueError("early_history needs early_threshold")
            _positive_finite("early_threshold", self.early_threshold)
        self._history = deque(maxlen=self.window)
        self._sorted = []

    @property
    def history_len(self) -> int:
        """Number of u-values currently in the window."""
        return len(self._history)

    def update(self, x: float) -> SpikeResult:
        """Score ``x`` against the previous window, then add its u-value to the window."""
        x = float(x)
        n = len(self._history)
        warmup = n < self.min_history
        threshold: float | None = self.threshold
        if warmup and self.early_history is not None and n >= self.early_history:
            threshold = self.early_threshold  # the early regime: scored, a wider threshold
        elif warmup:
            threshold = None
        if not math.isfinite(x) or x + self.eps <= 0.0:
            direction = 0 if math.isnan(x) else (1 if x > 0 else -1)
            return SpikeResult(
                x=x,
                u=None,
                median=None,
                mad=None,
                z=None,
                direction=direction,
                spike=True,
                warmup=warmup,
                nonfinite=True,
            )
        u = math.log(x + self.eps)
        if threshold is None:
            self._add(u)
            return SpikeResult(
                x=x,
                u=u,
                median=None,
                mad=None,
                z=None,
                direction=0,
                spike=False,
                warmup=True,
                nonfinite=False,
            )
        q, d = trend_median_mad(list(self._history)) if warmup else sorted_median_mad(self._sorted)
        z = abs(robust_z(u - q, d, self.min_spread))
        direction = (u > q) - (u < q)
        self._add(u)
        return SpikeResult(
            x=x,
            u=u,
            median=q,
            mad=d,
            z=z,
            direction=direction,
            spike=direction > 0 and z > threshold,
            warmup=warmup,
            nonfinite=False,
        )

    def median(self) -> float | None:
        """q_t of the next ``update``: the window's median u once it holds ``min_history``
        values (the full-window regime), else None."""
        if len(self._sorted) < (self.min_history or self.window):
            return None
        return sorted_median(self._sorted)

    def peek(self, x: float) -> SpikeResult:
        """Score ``x`` against the window as ``update`` would, without adding it."""
        saved = self._history.copy(), self._sorted.copy()
        try:
            return self.update(x)
        finally:
            self._history, self._sorted = saved

    def push(self, x: float) -> None:
        """Add ``x`` to the window without scoring it (a value that is not examined at this
        step, but is history for later ones); non-finite values are left out."""
        x = float(x)
        if math.isfinite(x) and x + self.eps > 0.0:
            self._add(math.log(x + self.eps))

    def _add(self, u: float) -> None:
        """Append u to the window, dropping the oldest value when it is full, and keep the
        ascending copy in step (O(window) moves, no sort)."""
        if len(self._history) == self.window:
            del self._sorted[bisect_left(self._sorted, self._history[0])]
        self._history.append(u)
        insort(self._sorted, u)

    def to_state(self) -> dict[str, object]:
        """Configuration and window as plain JSON types."""
        return {
            "window": self.window,
            "min_history": self.min_history,
            "threshold": self.threshold,
            "eps": self.eps,
            "min_spread": self.min_spread,
            "early_history": self.early_history,
            "early_threshold": self.early_threshold,
            "history": list(self._history),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RobustSpikeDetector:
        """Rebuild a detector from ``to_state()`` output."""
        detector = cls(
            window=int(state["window"]),
            min_history=int(state["min_history"]),
            threshold=float(state["threshold"]),
            eps=float(state["eps"]),
            min_spread=float(state.get("min_spread", MIN_SPREAD)),  # absent before the floor
            early_history=state.get("early_history"),  # absent before the early regime
            early_threshold=state.get("early_threshold"),
        )
        history = [float(u) for u in state["history"]]
        if len(history) > detector.window:
            raise ValueError(
                f"history has {len(history)} values, more than window={detector.window}"
            )
        if not all(math.isfinite(u) for u in history):
            raise ValueError("history must contain only finite u-values")
        detector._history.extend(history)
        detector._sorted = sorted(history)
        return detector


def pack_detectors(detectors: Mapping[int, RobustSpikeDetector]) -> dict[str, Any]:
    """Per-rank spike detectors' state: their configuration once and their windows packed
    (``packed.pack``), where a dict per rank wrote every rank's configuration and its window
    as a JSON list (~40 KB more a step at 2,048 ranks until the windows are full, every
    float formatted on each store write). Detectors configured differently keep that form."""
    states = {rank: d.to_state() for rank, d in detectors.items()}
    configs = [{k: v for k, v in st.items() if k != "history"} for st in states.values()]
    if any(c != configs[0] for c in configs[1:]):
        return {str(rank): st for rank, st in states.items()}
    return {
        "packed": {
            "ranks": list(states),
            "config": configs[0] if configs else {},
            **pack([st["history"] for st in states.values()]),
        }
    }


def unpack_detectors(state: Mapping[str, Any]) -> dict[int, RobustSpikeDetector]:
    """The detectors ``pack_detectors`` saved, or a dict per rank (its other form, and every
    state saved before it)."""
    packed = state.get("packed")
    if packed is None:
        return {int(k): RobustSpikeDetector.from_state(v) for k, v in state.items()}
    histories = unpack(packed)
    if len(histories) != len(packed["ranks"]):
        raise ValueError(f"{len(histories)} windows for {len(packed['ranks'])} ranks")
    return {
        int(rank): RobustSpikeDetector.from_state({**packed["config"], "history": history})
        for rank, history in zip(packed["ranks"], histories)
    }


@dataclass(frozen=True, slots=True)
class CoSpikeResult:
    """One co-spike update: this step's flag and magnitude, then the running totals."""

    co_spike: bool
    nonfinite: bool
    magnitude: float
    count: int
    nonfinite_count: int
    cumulative_magnitude: float


@dataclass(kw_only=True, slots=True)
class CoSpikeTracker:
    """Co-spike indicator C_t = 1[loss spike] * 1[grad-norm spike] (seeds 001 §4).

    Keeps the cumulative count and cumulative magnitude. The magnitude of one
    co-spike step is min(z_loss, z_grad): how far the weaker of the two moved.
    A co-spike where either side is non-finite has no z; it is counted in
    ``count`` (and in ``nonfinite_count``) but adds nothing to the magnitude,
    which therefore stays finite.
    """

    count: int = 0
    nonfinite_count: int = 0
    cumulative_magnitude: float = 0.0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count!r}")
        if not 0 <= self.nonfinite_count <= self.count:
            raise ValueError(
                f"nonfinite_count must be in [0, count={self.count}], got {self.nonfinite_count!r}"
            )
        if not (math.isfinite(self.cumulative_magnitude) and self.cumulative_magnitude >= 0):
            raise ValueError(
                f"cumulative_magnitude must be finite and >= 0, got {self.cumulative_magnitude!r}"
            )

    def update(self, loss: SpikeResult, grad: SpikeResult) -> CoSpikeResult:
        """Combine the loss and gradient-norm results of the same step."""
        co_spike = loss.spike and grad.spike
        nonfinite = co_spike and (loss.nonfinite or grad.nonfinite)
        magnitude = 0.0
        if co_spike:
            self.count += 1
            if nonfinite:
                self.nonfinite_count += 1
            else:
                magnitude = min(loss.z, grad.z)
                self.cumulative_magnitude += magnitude
        return CoSpikeResult(
            co_spike=co_spike,
            nonfinite=nonfinite,
            magnitude=magnitude,
            count=self.count,
            nonfinite_count=self.nonfinite_count,
            cumulative_magnitude=self.cumulative_magnitude,
        )

    def to_state(self) -> dict[str, object]:
        """Running totals as plain JSON types."""
        return {
            "count": self.count,
            "nonfinite_count": self.nonfinite_count,
            "cumulative_magnitude": self.cumulative_magnitude,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> CoSpikeTracker:
        """Rebuild a tracker from ``to_state()`` output."""
        return cls(
            count=int(state["count"]),
            nonfinite_count=int(state["nonfinite_count"]),
            cumulative_magnitude=float(state["cumulative_magnitude"]),
        )


@dataclass(frozen=True, slots=True)
class ClipRateResult:
    """Clip rate after one step; ``warmup`` while fewer than ``window`` steps are seen."""

    rate: float
    clipped: bool
    n_steps: int
    warmup: bool


@dataclass(kw_only=True, slots=True)
class ClipRateWindow:
    """Clip = (1/W) sum_t 1[G2_t > c] over the last W steps (seeds 001 §4).

    Before W steps exist the rate is taken over the steps seen and flagged as
    warm-up. A NaN norm counts as clipped: the step was not a normal update
    with a norm known to be <= c (and +inf > c anyway).
    """

    window: int
    threshold_c: float
    _flags: deque[bool] = field(init=False, repr=False, compare=False)
    _n_clipped: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window!r}")
        _positive_finite("threshold_c", self.threshold_c)
        self._flags = deque(maxlen=self.window)
        self._n_clipped = 0

    def update(self, g2: float) -> ClipRateResult:
        """Add one step's pre-clip global gradient norm G2 and return the rate."""
        g2 = float(g2)
        clipped = math.isnan(g2) or g2 > self.threshold_c
        if len(self._flags) == self.window and self._flags[0]:
            self._n_clipped -= 1
        self._flags.append(clipped)
        self._n_clipped += clipped
        n = len(self._flags)
        return ClipRateResult(
            rate=self._n_clipped / n, clipped=clipped, n_steps=n, warmup=n < self.window
        )

    def to_state(self) -> dict[str, object]:
        """Configuration and window flags as plain JSON types."""
        return {"window": self.window, "threshold_c": self.threshold_c, "flags": list(self._flags)}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ClipRateWindow:
        """Rebuild a window from ``to_state()`` output."""
        clip = cls(window=int(state["window"]), threshold_c=float(state["threshold_c"]))
        flags = [bool(f) for f in state["flags"]]
        if len(flags) > clip.window:
            raise ValueError(f"flags has {len(flags)} entries, more than window={clip.window}")
        clip._flags.extend(flags)
        clip._n_clipped = sum(flags)
        return clip


@dataclass(kw_only=True, slots=True)
class RankLevels:
    """Each rank's log-ratio u_r,t = log rho_r,t scored against that rank's own history.

    Per rank: the last ``recent`` (step, u) values, and its history, the ``window`` values
    before those (a value moves into the history when it leaves the recent span, so a
    sustained move never becomes its own baseline while it is being scored). The
    baseline b_r = median(history), defined once the history holds ``min_history`` values.
    ``held(rank, steps, q)`` = exp(q-quantile of u_r - b_r over the rank's last ``steps``
    values), provided they are ``steps`` consecutive steps ending at the latest one
    (NumPy's default linear interpolation): q = 0 is the level the rank held on every one
    of those steps, q = 0.25 the level it held on three steps in four. State: plain JSON
    types, R x (window + recent) floats for R ranks.
    """

    window: int = 100
    recent: int = 40
    min_history: int | None = None
    floor: float = 1.0
    _recent: dict[int, deque[tuple[int, float]]] = field(init=False, repr=False, compare=False)
    _history: dict[int, deque[float]] = field(init=False, repr=False, compare=False)
    _sorted: dict[int, list[float]] = field(init=False, repr=False, compare=False)
    _step: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.window < 3:
            raise ValueError(f"window must be >= 3, got {self.window!r}")
        if self.recent < 1:
            raise ValueError(f"recent must be >= 1, got {self.recent!r}")
        if self.min_history is None:
            self.min_history = self.window
        if not 3 <= self.min_history <= self.window:
            raise ValueError(
                f"min_history must be in [3, window={self.window}], got {self.min_history!r}"
            )
        self._recent, self._history, self._sorted, self._step = {}, {}, {}, None

    def update(self, step: int, ratios: Mapping[int, float]) -> None:
        """Add one step's ratios rho_r (finite, > 0; others are not measurements)."""
        self._step = step
        for rank, rho in ratios.items():
            rho = float(rho)
            if not (math.isfinite(rho) and rho > 0.0):
                continue
            recent = self._recent.setdefault(rank, deque())
            recent.append((step, math.log(rho)))
            while len(recent) > self.recent:
                self._retire(rank, recent.popleft()[1])

    def _retire(self, rank: int, u: float) -> None:
        """Move u from the rank's recent span into its history (and the ascending copy)."""
        history = self._history.get(rank)
        if history is None:
            history = self._history[rank] = deque(maxlen=self.window)
            self._sorted[rank] = []
        ordered = self._sorted[rank]
        if len(history) == self.window:
            del ordered[bisect_left(ordered, history[0])]
        history.append(u)
        insort(ordered, u)

    def baseline(self, rank: int) -> float | None:
        """exp(b_r): the ratio the rank usually holds, at least ``floor`` (parity by
        default: a rank that is usually faster than the others is judged against parity,
        not against its own speed, so the others' history, distorted while a third rank
        straggled, does not make them stragglers when it recovers); None while its history
        is short."""
        ordered = self._sorted.get(rank)
        if ordered is None or len(ordered) < self.min_history:
            return None
        return max(self.floor, math.exp(sorted_median(ordered)))

    def held(self, rank: int, steps: int, quantile: float) -> float | None:
        """exp(quantile of u_r - b_r over the last ``steps`` consecutive steps); None in
        warm-up, when the rank lacks a value on one of them, or steps > ``recent``."""
        if not 1 <= steps <= self.recent:
            raise ValueError(f"steps must be in [1, recent={self.recent}], got {steps!r}")
        base = self.baseline(rank)
        recent = self._recent.get(rank)
        if base is None or not recent or len(recent) < steps or self._step is None:
            return None
        first = recent[len(recent) - steps][0]
        if recent[-1][0] != self._step or recent[-1][0] - first != steps - 1:
            return None
        u = map(_VALUE, islice(recent, len(recent) - steps, None))
        level = min(u) if quantile == 0.0 else sorted_quantile(sorted(u), quantile)
        return math.exp(level - math.log(base))

    def latest(self, rank: int) -> float | None:
        """rho_r at the latest step, None when the rank had no value there."""
        recent = self._recent.get(rank)
        if not recent or recent[-1][0] != self._step:
            return None
        return math.exp(recent[-1][1])

    @property
    def ranks(self) -> list[int]:
        return sorted(self._recent)

    def to_state(self) -> dict[str, object]:
        return {
            "window": self.window,
            "recent": self.recent,
            "min_history": self.min_history,
            "floor": self.floor,
            "step": self._step,
            "packed": {  # ``packed``: JSON lists of every rank's floats cost 0.2 s a step
                "ranks": list(self._recent),
                "recent": pairs(list(self._recent.values())),
                "history": pack([self._history.get(r, ()) for r in self._recent]),
            },
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> RankLevels:
        levels = cls(
            window=int(state["window"]),
            recent=int(state["recent"]),
            min_history=int(state["min_history"]),
            floor=float(state.get("floor", 1.0)),
        )
        levels._step = None if state["step"] is None else int(state["step"])
        if "packed" in state:
            saved = state["packed"]
            ranks = [int(r) for r in saved["ranks"]]
            kept = zip(ranks, unpairs(saved["recent"]), unpack(saved["history"]), strict=True)
        else:  # saved as JSON lists, before ``packed``
            kept = (
                (int(r), [(int(s), float(u)) for s, u in v["recent"]], v["history"])
                for r, v in state["ranks"].items()
            )
        for rank, recent, history in kept:
            if len(recent) > levels.recent or len(history) > levels.window:
                raise ValueError(f"rank {rank}: more values than recent/window hold")
            levels._recent[rank] = deque(recent)
            for u in history:
                levels._retire(rank, float(u))
        return levels


def calibrate(
    series: Sequence[float],
    window: int,
    quantile: float = 0.999,
    margin: float = 1.5,
    eps: float = 1e-8,
) -> float:
    """Derive a z threshold from a stable run (seeds 001 §4, "Thresholds").

    Rule: replay a RobustSpikeDetector(window, min_history=window, eps) over the
    series, collect every scored z (warm-up steps excluded), and return
    margin * quantile(z) with NumPy's default linear interpolation. The series
    must come from a stable run: a non-finite value, too few values to score
    (len <= window) or a zero result (no spread at all) raise ValueError.
    """
    if not 0.0 < quantile <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
    _positive_finite("margin", margin)
    detector = RobustSpikeDetector(window=window, min_history=window, eps=eps)
    scores: list[float] = []
    for step, x in enumerate(series):
        result = detector.update(x)
        if result.nonfinite:
            raise ValueError(f"series[{step}] = {x!r} is not usable; calibrate on a stable run")
        if result.z is not None:
            scores.append(result.z)
    if not scores:
        raise ValueError(f"series needs more than window={window} values, got {len(series)}")
    threshold = margin * float(np.quantile(np.asarray(scores, dtype=np.float64), quantile))
    if threshold <= 0.0:
        raise ValueError("series has no spread: the calibrated threshold would be 0")
    return threshold
