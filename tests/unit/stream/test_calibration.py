"""Thresholds from a stable run: margin x quantile of the detector's own z-scores."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from probewire.stream.calibration import (
    calibrate_run,
    heldout_rises,
    residual_bounds,
    straggler_levels,
)
from probewire.stream.derive import own_time_ratios
from probewire.stream.findings import DetectorConfig
from probewire.stream.stragglers import StragglerRules


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
            detectors=DetectorConfig(maxvio_steps=3, straggler_steps=4),
        )
    }
    assert got["maxvio_threshold"].threshold == pytest.approx(
        reference_held(maxvio, 3, 50, 0.99, 1.25), rel=1e-12
    )
    # the straggler tier: its rule's level (over its own baseline), every rank count
    levels = reference_straggler_levels(own, 50, 40, 4, 0.0)
    assert got["straggler_ratio"].threshold == pytest.approx(
        1.25 * float(np.quantile(levels[~np.isnan(levels)], 0.99)), rel=1e-12
    )
    # held for k steps is never above the single-step quantile
    assert got["maxvio_threshold"].threshold <= 1.25 * np.quantile(
        [x for x in maxvio[50:] if x is not None], 0.99
    )
    assert got["maxvio_threshold"].n_steps == 248


def reference_straggler_levels(ratios, window, recent, k, q):
    """The straggler tiers' level at each step of a fully measured column, by sliding
    windows: exp(q-quantile of log rho over the last k steps - max(0, median of the
    ``window`` log values before the last ``recent``)); NaN in warm-up."""
    u = np.log(np.asarray(ratios, dtype=np.float64))
    levels = np.full(len(u), np.nan)
    tops = np.quantile(sliding_window_view(u, k), q, axis=1)  # tops[i]: u[i .. i + k - 1]
    bases = np.maximum(0.0, np.median(sliding_window_view(u, window), axis=1))
    for t in range(recent + window - 1, len(u)):
        levels[t] = np.exp(tops[t - k + 1] - bases[t - recent - window + 1])
    return levels


def three_ranks(rng, steps, slow=None):
    """Own-time ratios of 3 ranks with log-normal own times; ``slow`` = (rank, factor,
    first step, last step) makes that rank's own time factor x longer there."""
    own = np.exp(rng.normal(0.0, 0.04, size=(steps, 3)))
    if slow is not None:
        rank, factor, first, last = slow
        own[first : last + 1, rank] *= factor
    return [own_time_ratios({r: float(o) for r, o in enumerate(row)}) for row in own]


def stable_series(rng, steps):
    return {
        "loss": list(3 * np.exp(rng.normal(0, 0.02, steps))),
        "grad_norm": list(0.5 * np.exp(rng.normal(0, 0.1, steps))),
        "step_time_s": list(0.1 * np.exp(rng.normal(0, 0.05, steps))),
    }


def test_straggler_held_and_recent_ratios_are_their_rules_level_on_the_worst_ranks_ratio():
    """margin x quantile of the level each tier's rule computes (its level quantile of k
    steps over the baseline), on the steps with 3+ ranks; straggler_ratio on all of them."""
    rng = np.random.default_rng(6)
    steps, window = 400, 50
    column = [max(r.values()) for r in three_ranks(rng, steps)]
    ranks = [2 if 250 <= t < 262 else 3 for t in range(steps)]  # a rank away 12 steps
    cfg = DetectorConfig(straggler_held_steps=30, straggler_recent_steps=10)
    got = {
        c.setting: c
        for c in calibrate_run(
            {**stable_series(rng, steps), "straggler_own_ratio": column, "ranks_reporting": ranks},
            window,
            quantile=0.95,
            margin=1.2,
            detectors=cfg,
        )
    }
    three = np.asarray(ranks) >= 3
    for setting, k, q, where in (
        ("straggler_ratio", 3, 0.0, np.ones(steps, bool)),
        ("straggler_held_ratio", 30, 0.1, three),
        ("straggler_recent_ratio", 10, 0.3, three),
    ):
        levels = reference_straggler_levels(column, window, 30, k, q)
        scored = levels[where & ~np.isnan(levels)]
        assert got[setting].n_steps == len(scored) == (steps - 79 - (12 if q else 0))
        assert got[setting].threshold == pytest.approx(
            1.2 * float(np.quantile(scored, 0.95)), rel=1e-12
        )
    # a missing step breaks the k-step run as the rule's does: no level until k more
    gappy = list(column)
    gappy[200] = None
    levels = straggler_levels(gappy, window, 30, 10, 0.3)
    assert levels[199] is not None and all(v is None for v in levels[200:210])
    assert levels[210] is not None


def test_a_held_straggler_exceeds_the_recent_ratio_calibrated_on_the_stable_part():
    """Calibrated on a run's stable steps, the tiers stay quiet there and page a rank 1.3x
    slower than the others for 20 steps (the CUSUM off: the held tiers alone)."""
    rng = np.random.default_rng(7)
    stable, steps = 400, 430
    ratios = three_ranks(rng, steps, slow=(1, 1.3, stable, stable + 19))
    column = [max(r.values()) for r in ratios[:stable]]
    got = {
        c.setting: c.threshold
        for c in calibrate_run(
            {
                **stable_series(rng, stable),
                "straggler_own_ratio": column,
                "ranks_reporting": [3] * stable,
            },
            window=100,
            quantile=0.999,
            margin=1.1,
        )
    }
    assert 1.0 < got["straggler_recent_ratio"] < 1.3
    cfg = DetectorConfig(
        straggler_ratio=got["straggler_ratio"],
        straggler_held_ratio=got["straggler_held_ratio"],
        straggler_recent_ratio=got["straggler_recent_ratio"],
        straggler_cusum_h=1e9,
    )
    rules = StragglerRules(cfg)
    paged, recent = {}, {}
    for t, r in enumerate(ratios):
        paged[t] = rules.observe(t, r)
        recent[t] = rules.levels.held(1, cfg.straggler_recent_steps, cfg.straggler_recent_quantile)
    assert not any(paged[t] for t in range(stable))
    fault = [t for t in range(stable, steps) if paged[t]]
    assert fault and fault[0] < stable + 20
    assert {f.culprit for t in fault for f in paged[t]} == {"rank 1"}
    # the recent tier's own level of the slow rank passes its calibrated ratio in the fault
    assert max(recent[t] for t in range(stable, stable + 20)) >= got["straggler_recent_ratio"]
    assert (
        max(v for t in range(stable) if (v := recent[t]) is not None)
        < got["straggler_recent_ratio"]
    )


def test_residual_bounds_are_the_quantiles_of_each_steps_extreme_branch():
    rng = np.random.default_rng(8)
    steps, branches = 150, 6
    ratio = np.exp(rng.normal(np.log(0.3), 0.5, size=(steps, branches)))
    ratio[rng.random((steps, branches)) < 0.05] = np.nan  # not stored: not a measurement
    measured = [t for t in range(steps) if t % 10 != 3]  # scan steps only
    rows = [
        (t, float(ratio[t, b])) for b in range(branches) for t in measured
    ]  # branch-major, as the table's key orders them
    high, low, n = residual_bounds(rows, 0.99, 1.5)
    table = ratio[measured]
    assert n == len(measured)
    assert high == pytest.approx(
        1.5 * float(np.quantile(np.nanmax(table, axis=1), 0.99)), rel=1e-12
    )
    assert low == pytest.approx(float(np.quantile(np.nanmin(table, axis=1), 0.01)) / 1.5, rel=1e-12)
    got = {
        c.setting: c for c in calibrate_run(stable_series(rng, 300), 50, 0.99, 1.5, residual=rows)
    }
    assert (got["residual_ratio_max"].threshold, got["residual_ratio_min"].threshold) == (high, low)
    assert got["residual_ratio_max"].column == "residual_stats.ratio"
    assert residual_bounds([(1, float("nan")), (2, None)], 0.99, 1.5) is None


def test_heldout_bpb_rise_is_the_quantile_of_each_evaluations_rise_over_its_suites_median():
    rng = np.random.default_rng(9)
    rows, expected = [], []
    for suite, scale in (("a", 1.0), ("b", 0.8)):
        steps = np.arange(0, 2000, 50)
        bpb = scale * (1 + 0.5 * np.exp(-steps / 400)) * np.exp(rng.normal(0, 0.01, len(steps)))
        bpb[7] = np.nan  # a diverged evaluation: pages on its own, not in the history
        for step, value in zip(steps, bpb):
            rows.append((suite, int(step), float(value)))
        rows.append((suite, 100, 9.0))  # a re-delivery of step 100: skipped
        finite = bpb[~np.isnan(bpb)]
        for i in range(3, len(finite)):
            expected.append(finite[i] / np.median(finite[max(0, i - 5) : i]) - 1)
    rows.sort(key=lambda r: (r[0], r[1]))
    got = heldout_rises(rows, window=5, min_history=3)
    assert len(got) == len(expected)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    (cal,) = [
        c
        for c in calibrate_run(stable_series(rng, 300), 50, 0.99, 1.5, evaluations=rows)
        if c.setting == "heldout_bpb_rise"
    ]
    assert cal.threshold == pytest.approx(1.5 * float(np.quantile(expected, 0.99)), rel=1e-12)
    assert cal.column == "evaluations.bpb" and cal.n_steps == len(expected)


def test_absent_series_give_no_straggler_tier_residual_or_heldout_row():
    rng = np.random.default_rng(10)
    column = [max(r.values()) for r in three_ranks(rng, 300)]
    only_two = {
        **stable_series(rng, 300),
        "straggler_own_ratio": column,
        "ranks_reporting": [2] * 300,
    }
    settings = {
        c.setting
        for c in calibrate_run(
            only_two,
            50,
            residual=[(1, float("nan"))],
            evaluations=[("a", 0, 1.0), ("a", 50, 0.9), ("a", 100, 0.8)],  # too few to score
        )
    }
    assert settings == {
        "loss_z_threshold",
        "grad_z_threshold",
        "signal_z_threshold",
        "straggler_ratio",
    }
    falling = [("a", 50 * i, 2.0 - 0.1 * i) for i in range(10)]  # only ever falls: no rise
    assert all(r < 0 for r in heldout_rises(falling, 5, 3))
    assert "heldout_bpb_rise" not in {
        c.setting for c in calibrate_run(stable_series(rng, 300), 50, evaluations=falling)
    }


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
