"""Thresholds from a stable run: margin x quantile of the detector's own z-scores."""

from __future__ import annotations

import numpy as np
import pytest

from probewire.stream.calibration import calibrate_run


def reference_threshold(values, window, quantile, margin):
    u = np.log(np.asarray(values, dtype=np.float64) + 1e-8)
    z = []
    for t in range(window, len(u)):
        past = u[t - window:t]
        q = np.median(past)
        d = np.median(np.abs(past - q))
        z.append(0.6745 * abs(u[t] - q) / (d + 1e-8))
    return margin * float(np.quantile(z, quantile))


def test_thresholds_match_a_numpy_replay_and_skip_missing_values():
    rng = np.random.default_rng(0)
    series = {"loss": list(3 * np.exp(rng.normal(0, 0.02, 300))),
              "grad_norm": list(0.5 * np.exp(rng.normal(0, 0.1, 300))),
              "step_time_s": [None] * 5 + list(0.1 * np.exp(rng.normal(0, 0.05, 295)))}
    got = {c.setting: c for c in calibrate_run(series, window=50, quantile=0.99, margin=1.5)}
    assert got["loss_z_threshold"].threshold == pytest.approx(
        reference_threshold(series["loss"], 50, 0.99, 1.5), rel=1e-9)
    assert got["signal_z_threshold"].n_steps == 295
    assert got["signal_z_threshold"].threshold == pytest.approx(
        reference_threshold(series["step_time_s"][5:], 50, 0.99, 1.5), rel=1e-9)


def test_too_short_a_run_is_refused():
    with pytest.raises(ValueError, match="more than window"):
        calibrate_run({"loss": [1.0] * 10, "grad_norm": [1.0] * 10, "step_time_s": [1.0] * 10},
                      window=20)
