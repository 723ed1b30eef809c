"""Thresholds from a stable run: margin x quantile of the detector's own z-scores."""

from __future__ import annotations

import numpy as np
import pytest

from probewire.stream.calibration import calibrate_run


def reference_threshold(values, window, quantile, margin):
    u = np.log(np.asarray(values, dtype=np.float64) + 1e-8)
    z = []
    for t in range(window, len(u)):
        past = u[t - window : t]
        q = np.median(past)
        d = np.median(np.abs(past - q))
        z.append(0.6745 * abs(u[t] - q) / max(d, 1e-3))  # the spread floor, relative
    return margin * float(np.quantile(z, quantile))


def test_thresholds_match_a_numpy_replay_and_skip_missing_values():
    rng = np.random.default_rng(0)
    series = {
        "loss": list(3 * np.exp(rng.normal(0, 0.02, 300))),
        "grad_norm": list(0.5 * np.exp(rng.normal(0, 0.1, 300))),
        "step_time_s": [None] * 5 + list(0.1 * np.exp(rng.normal(0, 0.05, 295))),
    }
    got = {c.setting: c for c in calibrate_run(series, window=50, quantile=0.99, margin=1.5)}
    assert got["loss_z_threshold"].threshold == pytest.approx(
        reference_threshold(series["loss"], 50, 0.99, 1.5), rel=1e-9
    )
    assert got["signal_z_threshold"].n_steps == 295
    assert got["signal_z_threshold"].threshold == pytest.approx(
        reference_threshold(series["step_time_s"][5:], 50, 0.99, 1.5), rel=1e-9
    )


def test_too_short_a_run_is_refused():
    with pytest.raises(ValueError, match="more than window"):
        calibrate_run(
            {"loss": [1.0] * 10, "grad_norm": [1.0] * 10, "step_time_s": [1.0] * 10}, window=20
        )


def reference_held(values, k, skip, quantile, margin):
    """Rolling minimum over k consecutive measured values (None breaks), after ``skip``."""
    v = values[skip:]
    held = [
        min(v[i - k + 1 : i + 1])
        for i in range(k - 1, len(v))
        if all(x is not None for x in v[i - k + 1 : i + 1])
    ]
    return margin * float(np.quantile(np.asarray(held, dtype=np.float64), quantile))


def test_held_levels_are_the_quantile_of_the_k_step_rolling_minimum():
    rng = np.random.default_rng(1)
    base = {
        "loss": list(3 * np.exp(rng.normal(0, 0.02, 300))),
        "grad_norm": list(0.5 * np.exp(rng.normal(0, 0.1, 300))),
        "step_time_s": list(0.1 * np.exp(rng.normal(0, 0.05, 300))),
    }
    maxvio = [float(x) for x in rng.gamma(4.0, 0.2, 300)]
    maxvio[120] = maxvio[121] = None  # steps without a measurement break a run
    own = [1.0 + float(x) for x in rng.exponential(0.3, 300)]
    got = {
        c.setting: c
        for c in calibrate_run(
            {**base, "moe_maxvio": maxvio, "straggler_own_ratio": own},
            window=50,
            quantile=0.99,
            margin=1.25,
            held_steps={"maxvio_steps": 3, "straggler_steps": 4},
        )
    }
    assert got["maxvio_threshold"].threshold == pytest.approx(
        reference_held(maxvio, 3, 50, 0.99, 1.25), rel=1e-12
    )
    assert got["straggler_ratio"].threshold == pytest.approx(
        reference_held(own, 4, 50, 0.99, 1.25), rel=1e-12
    )
    # held for k steps is never above the single-step quantile
    assert got["maxvio_threshold"].threshold <= 1.25 * np.quantile(
        [x for x in maxvio[50:] if x is not None], 0.99
    )
    assert got["maxvio_threshold"].n_steps == 248


def test_a_run_without_experts_or_ranks_gets_no_held_threshold():
    rng = np.random.default_rng(2)
    series = {
        "loss": list(3 * np.exp(rng.normal(0, 0.02, 200))),
        "grad_norm": list(np.exp(rng.normal(0, 0.1, 200))),
        "step_time_s": list(0.1 * np.exp(rng.normal(0, 0.05, 200))),
        "moe_maxvio": [None] * 200,
    }
    assert {c.setting for c in calibrate_run(series, window=50)} == {
        "loss_z_threshold",
        "grad_z_threshold",
        "signal_z_threshold",
    }


def test_a_run_shorter_than_three_windows_is_refused_with_what_it_needs():
    """120 steps under a 100-step window would put thresholds on 20 scores: refused, with
    the minimum and the way out in the message."""
    rng = np.random.default_rng(4)
    series = {
        column: list(np.exp(rng.normal(0, 0.02, 360)))
        for column in ("loss", "grad_norm", "step_time_s")
    }
    short = {column: values[:120] for column, values in series.items()}
    with pytest.raises(ValueError, match=r"120 steps.*3 detector windows.*3 x 100 = 300"):
        calibrate_run(short, window=100)
    assert len(calibrate_run(series, window=100)) == 3  # 360 steps: calibrated


def test_drift_and_audit_thresholds_match_numpy_references():
    from probewire.stream.calibration import audit_level, drift_level

    rng = np.random.default_rng(4)
    h = [None if t % 17 == 0 else 0.9 + 0.01 * float(rng.normal()) for t in range(300)]
    got = drift_level(h, window=50, steps=3, direction=-1, quantile=0.99, margin=1.5)
    measured = [(t, v) for t, v in enumerate(h) if v is not None]
    moves: dict[int, float] = {}
    for i, (t, v) in enumerate(measured):
        if i >= 50:
            moves[t] = -(v - float(np.median([w for _, w in measured[i - 50 : i]])))
    held = [
        min(moves[t - 2], moves[t - 1], moves[t])
        for t in moves
        if t - 1 in moves and t - 2 in moves
    ]
    assert got == pytest.approx(1.5 * float(np.quantile(held, 0.99)), rel=1e-12)
    g2 = list(0.5 * np.exp(rng.normal(0, 0.1, 300)))
    reported = [g * (1 + 1e-3 * float(rng.normal())) for g in g2]
    reported[7] = None
    rel = np.array([abs(r - m) / m for r, m in zip(reported, g2) if r is not None])
    assert audit_level(reported, g2, 0.99, 1.5) == pytest.approx(
        1.5 * float(np.quantile(rel, 0.99)), rel=1e-12
    )
    assert audit_level([None] * 3, [1.0] * 3, 0.99, 1.5) is None


def test_a_stable_run_calibrates_the_new_rules_thresholds():
    rng = np.random.default_rng(5)
    n = 300
    g2 = list(0.5 * np.exp(rng.normal(0, 0.1, n)))
    series = {
        "loss": list(3 * np.exp(rng.normal(0, 0.02, n))),
        "grad_norm": g2,
        "step_time_s": list(0.1 * np.exp(rng.normal(0, 0.05, n))),
        "clip_rate": list(0.1 + 0.02 * rng.random(n)),
        "moe_h_norm": list(0.9 + 0.01 * rng.normal(size=n)),
        "moe_shard_imbalance": list(1.1 + 0.02 * rng.random(n)),
        "grad_clip_norm": [g * (1 + 1e-3 * float(rng.normal())) for g in g2],
    }
    got = {c.setting: c.threshold for c in calibrate_run(series, 50, 0.999, 1.5)}
    assert {"clip_rate_rise", "h_norm_drop", "shard_imbalance_max", "grad_audit_tolerance"} <= set(
        got
    )
    assert 0 < got["clip_rate_rise"] < 0.05 and 0 < got["h_norm_drop"] < 0.05
    assert 1e-3 < got["grad_audit_tolerance"] < 1e-2
    assert 1.1 < got["shard_imbalance_max"] < 1.8
