"""Detector thresholds from a stable run's recorded series (seeds 001 §4, "Thresholds").

Calibrate on healthy runs, never on one failure: each z threshold is the margin times a
high quantile of the robust z-scores the detector itself produced on the stable series.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .detect import calibrate

__all__ = ["Calibration", "calibrate_run"]

# stream setting -> step_metrics column it is calibrated on
CALIBRATED = {"loss_z_threshold": "loss", "grad_z_threshold": "grad_norm",
              "signal_z_threshold": "step_time_s"}


@dataclass(frozen=True, slots=True)
class Calibration:
    setting: str
    column: str
    threshold: float
    n_steps: int


def calibrate_run(series: Mapping[str, Sequence[float | None]], window: int,
                  quantile: float = 0.999, margin: float = 1.5) -> list[Calibration]:
    """One threshold per calibrated setting; missing values (None) are dropped first."""
    out = []
    for setting, column in CALIBRATED.items():
        values = [v for v in series.get(column, []) if v is not None and math.isfinite(v)]
        out.append(Calibration(setting, column, calibrate(values, window, quantile, margin),
                               len(values)))
    return out
