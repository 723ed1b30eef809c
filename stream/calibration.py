"""Detector thresholds from a stable run's recorded series (seeds 001 §4, "Thresholds").

Calibrate on healthy runs, never on one failure: each z threshold is the margin times a
high quantile of the robust z-scores the detector itself produced on the stable series.
The held-level rules (MaxVio, the straggler's own-time ratio: a value above a threshold
on k consecutive steps) get the margin times a high quantile of the level the stable run
held for k steps in a row (the rolling minimum over k consecutive measured steps, after
the detector window's warm-up). The drift rules (a clip-rate rise, an H_norm drop: a move
over the signal's own baseline) get the margin times a high quantile of the move the
stable run held, and the grad-norm audit the margin times a high quantile of the loop's
norm's relative mismatch to G2. A series the run does not have (no experts, one rank, a
loop that clips through the monitor) gives no threshold; a level of 0 (a constant clip
rate) gives none either (the default stays).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .detect import calibrate
from .series import Series
from .series import StepMetrics as SM

__all__ = [
    "COLUMNS",
    "DETECTOR_FIELDS",
    "MIN_WINDOWS",
    "Calibration",
    "audit_level",
    "calibrate_run",
    "drift_level",
    "held_level",
]

MIN_WINDOWS = 3
"""A stable run shorter than this many detector windows calibrates nothing: the first
window only warms the detector up, so fewer would put a threshold on a handful of scores."""

# stream setting -> step_metrics column it is calibrated on
CALIBRATED = {
    "loss_z_threshold": SM.loss,
    "grad_z_threshold": SM.grad_norm,
    "signal_z_threshold": SM.step_time_s,
}
# held-level setting -> (step_metrics column, the stream setting naming k)
HELD = {
    "maxvio_threshold": (SM.moe_maxvio, "maxvio_steps"),
    "straggler_ratio": (SM.straggler_own_ratio, "straggler_steps"),
    "shard_imbalance_max": (SM.moe_shard_imbalance, "maxvio_steps"),
}
# drift setting -> (step_metrics column, direction: +1 a rise is bad, -1 a drop, the k
# setting): margin x quantile of the move the stable run held for k steps over its own
# baseline (the median of the window before), the rules of ``directions``
DRIFT: dict[str, tuple[Series, int, str | None]] = {
    "clip_rate_rise": (SM.clip_rate, 1, None),
    "h_norm_drop": (SM.moe_h_norm, -1, "maxvio_steps"),
}
# the grad-norm audit: margin x quantile of |grad_clip_norm - G2| / G2 on the stable run
AUDIT = ("grad_audit_tolerance", SM.grad_clip_norm, SM.grad_norm)
COLUMNS = tuple(
    sorted(
        {
            *CALIBRATED.values(),
            *(c for c, _ in HELD.values()),
            *(c for c, _, _ in DRIFT.values()),
            *AUDIT[1:],
        }
    )
)
# calibrated setting -> its field of stream.stage2.detectors (DetectorConfig)
DETECTOR_FIELDS = {
    "loss_z_threshold": "loss_z",
    "grad_z_threshold": "grad_z",
    "signal_z_threshold": "signal_z",
    "maxvio_threshold": "maxvio_threshold",
    "straggler_ratio": "straggler_ratio",
    "shard_imbalance_max": "shard_imbalance_max",
    "clip_rate_rise": "clip_rate_rise",
    "h_norm_drop": "h_norm_drop",
    "grad_audit_tolerance": "grad_audit_tolerance",
}


@dataclass(frozen=True, slots=True)
class Calibration:
    setting: str
    column: str
    threshold: float
    n_steps: int


def held_level(
    values: Sequence[float | None], steps: int, skip: int, quantile: float, margin: float
) -> float | None:
    """margin x quantile of the rolling minimum over ``steps`` consecutive measured values
    (a missing value breaks the run), ignoring the first ``skip`` values; None when no
    run of ``steps`` values exists."""
    held: list[float] = []
    run: list[float] = []
    for v in list(values)[skip:]:
        run = [] if v is None or not math.isfinite(v) else (run + [v])[-steps:]
        if len(run) == steps:
            held.append(min(run))
    if not held:
        return None
    return margin * float(np.quantile(np.asarray(held, dtype=np.float64), quantile))


def drift_level(
    values: Sequence[float | None],
    window: int,
    steps: int,
    direction: int,
    quantile: float,
    margin: float,
) -> float | None:
    """margin x quantile of the move a stable run held on ``steps`` consecutive measured
    values over its baseline: d_t = direction (v_t - median of the up to ``window``
    measured values before it), from the ``window``-th measured value on; held = the
    rolling minimum of d over ``steps`` consecutive ones (a missing value breaks the run).
    None when no run exists."""
    seen: list[float] = []
    moves: list[float | None] = []
    for v in values:
        if v is None or not math.isfinite(v):
            moves.append(None)
            continue
        if len(seen) >= window:
            moves.append(direction * (v - float(np.median(seen[-window:]))))
        else:
            moves.append(None)
        seen.append(v)
    return held_level(moves, steps, 0, quantile, margin)


def audit_level(
    reported: Sequence[float | None],
    measured: Sequence[float | None],
    quantile: float,
    margin: float,
) -> float | None:
    """margin x quantile of |reported - measured| / measured over the steps with both
    (finite, measured > 0); None when the run has none (its loop clipped through the
    monitor, or did not report a norm)."""
    pairs = [
        (r, m)
        for r, m in zip(reported, measured)
        if r is not None and m is not None and math.isfinite(r) and math.isfinite(m) and m > 0
    ]
    if not pairs:
        return None
    rel = np.array([abs(r - m) / m for r, m in pairs], dtype=np.float64)
    return margin * float(np.quantile(rel, quantile))


def calibrate_run(
    series: Mapping[str, Sequence[float | None]],
    window: int,
    quantile: float = 0.999,
    margin: float = 1.5,
    held_steps: Mapping[str, int] | None = None,
) -> list[Calibration]:
    """One threshold per calibrated setting; missing values (None) are dropped first.
    ``held_steps`` maps each HELD setting's k setting (``maxvio_steps``, ...) to its value
    (default 3); a held-level series that is absent gives no row. A ValueError for a run
    shorter than ``MIN_WINDOWS`` windows."""
    steps = max((len(v) for v in series.values()), default=0)
    if steps < MIN_WINDOWS * window:
        raise ValueError(
            f"the run has {steps} steps: a series needs more than window={window} values, "
            f"and calibration at least {MIN_WINDOWS} detector windows of stable steps "
            f"({MIN_WINDOWS} x {window} = {MIN_WINDOWS * window}); calibrate on a longer "
            "stable run, or pass a smaller --window"
        )
    out = []
    for setting, column in CALIBRATED.items():
        values = [v for v in series.get(column, []) if v is not None and math.isfinite(v)]
        out.append(
            Calibration(setting, column, calibrate(values, window, quantile, margin), len(values))
        )
    for setting, (column, k_setting) in HELD.items():
        held_values = list(series.get(column, []))
        k = (held_steps or {}).get(k_setting, 3)
        level = held_level(held_values, k, window, quantile, margin)
        if level is not None:
            n = sum(v is not None for v in held_values[window:])
            out.append(Calibration(setting, column, level, n))
    for drift, (column, direction, k_of) in DRIFT.items():
        moved = list(series.get(column, []))
        k = (held_steps or {}).get(k_of, 3) if k_of else 1
        level = drift_level(moved, window, k, direction, quantile, margin)
        if level is not None and level > 0:
            out.append(Calibration(drift, column, level, sum(v is not None for v in moved)))
    audit, reported, measured = AUDIT
    level = audit_level(series.get(reported, []), series.get(measured, []), quantile, margin)
    if level is not None and level > 0:
        n = sum(v is not None for v in series.get(reported, []))
        out.append(Calibration(audit, reported, level, n))
    return out
