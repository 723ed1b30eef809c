"""Detector thresholds from a stable run's recorded series (seeds 001 §4, "Thresholds").

Calibrate on healthy runs, never on one failure: each z threshold is the margin times a
high quantile of the robust z-scores the detector itself produced on the stable series.
The held-level rules (MaxVio, the straggler's own-time ratio: a value above a threshold
on k consecutive steps) get the margin times a high quantile of the level the stable run
held for k steps in a row (the rolling minimum over k consecutive measured steps, after
the detector window's warm-up). A series the run does not have (no experts, one rank)
gives no threshold.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .detect import calibrate
from .series import StepMetrics as SM

__all__ = [
    "COLUMNS",
    "DETECTOR_FIELDS",
    "MIN_WINDOWS",
    "Calibration",
    "calibrate_run",
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
}
COLUMNS = tuple(sorted({*CALIBRATED.values(), *(c for c, _ in HELD.values())}))
# calibrated setting -> its field of stream.stage2.detectors (DetectorConfig)
DETECTOR_FIELDS = {
    "loss_z_threshold": "loss_z",
    "grad_z_threshold": "grad_z",
    "signal_z_threshold": "signal_z",
    "maxvio_threshold": "maxvio_threshold",
    "straggler_ratio": "straggler_ratio",
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
    return out
