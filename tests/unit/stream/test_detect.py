"""Spike detection, co-spikes, clip rate and calibration against float64 NumPy references."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from probewire.stream.detect import (
    ClipRateWindow,
    CoSpikeTracker,
    RobustSpikeDetector,
    calibrate,
    trend_median_mad,
)

EPS = 1e-8
FLOOR = 1e-3  # the spread floor on log values (0.1% of the level)


def reference_scores(xs, window, min_history, threshold=6.0, eps=EPS):
    """Per step (median, mad, z, spike, nonfinite) from explicit windows of earlier log-values."""
    kept: list[float] = []
    out = []
    for x in np.asarray(xs, dtype=np.float64):
        if not np.isfinite(x) or x + eps <= 0:
            out.append((None, None, None, True, True))
            continue
        u = np.log(x + eps)
        if len(kept) < min_history:
            out.append((None, None, None, False, False))
        else:
            win = np.array(kept[-window:])
            q = np.median(win)
            d = np.median(np.abs(win - q))
            z = 0.6745 * abs(u - q) / max(d, FLOOR)
            out.append((q, d, z, bool(u > q and z > threshold), False))
        kept.append(u)
    return out


def lognormal_series(n, seed):
    rng = np.random.default_rng(seed)
    xs = np.exp(rng.normal(0.5, 0.05, size=n))
    xs[[60, 90, 140]] *= [3.0, 0.3, 5.0]  # up, down, up
    return xs


@pytest.mark.parametrize(("window", "min_history"), [(20, 20), (20, 5), (3, 3)])
def test_scores_match_numpy_reference(window, min_history):
    xs = lognormal_series(200, seed=1)
    det = RobustSpikeDetector(window=window, min_history=min_history)
    got = [det.update(x) for x in xs]
    ref = reference_scores(xs, window, min_history)
    for r, (q, d, z, spike, nonfinite) in zip(got, ref, strict=True):
        assert (r.spike, r.nonfinite, r.z is None) == (spike, nonfinite, z is None)
        if z is not None:
            assert r.median == pytest.approx(q, rel=1e-12, abs=1e-15)
            assert r.mad == pytest.approx(d, rel=1e-12, abs=1e-15)
            assert r.z == pytest.approx(z, rel=1e-12, abs=1e-12)
    if window == 20 and min_history == 20:
        spikes = [i for i, r in enumerate(got) if r.spike]
        assert spikes == [60, 140]
        assert got[90].direction == -1 and got[90].z > 6.0 and not got[90].spike


def test_warmup_boundary_is_min_history():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    det = RobustSpikeDetector(window=10, min_history=5)
    results = [det.update(x) for x in xs]
    assert [r.warmup for r in results] == [True] * 5 + [False, False]
    assert all(r.z is None and not r.spike for r in results[:5])
    first_u = np.log(np.array(xs[:5]) + EPS)
    assert results[5].median == pytest.approx(np.median(first_u), rel=1e-12)
    assert det.history_len == 7


def test_current_value_is_not_in_its_own_window():
    det = RobustSpikeDetector(window=3)
    for x in (1.0, 2.0, 3.0):
        det.update(x)
    r = det.update(100.0)
    assert r.median == pytest.approx(np.log(2.0 + EPS), rel=1e-15)
    # window now holds 2, 3, 100: the median moved to 3
    assert det.update(3.0).median == pytest.approx(np.log(3.0 + EPS), rel=1e-15)


def test_a_constant_series_scores_a_move_against_the_floor_relative_to_the_level():
    """D = 0: z is the move in units of the floor (0.1% of the level), never millions."""
    det = RobustSpikeDetector(window=5)
    for _ in range(5):
        det.update(1.0e9)
    same = det.update(1.0e9)
    assert (same.mad, same.z, same.spike, same.direction) == (0.0, 0.0, False, 0)
    tiny = det.update(1.0e9 * (1 + 1e-6))
    assert tiny.mad == 0.0 and tiny.z == pytest.approx(0.6745 * 1e-6 / FLOOR, rel=1e-6)
    assert not tiny.spike
    moved = det.update(1.05e9)  # a 5% step of a constant series (a memory high-water mark)
    expected = 0.6745 * (np.log(1.05e9 + EPS) - np.log(1.0e9 + EPS)) / FLOOR
    assert moved.z == pytest.approx(expected, rel=1e-9)
    assert 30 < moved.z < 40 and moved.spike and moved.direction == 1


def test_push_adds_to_the_window_without_scoring():
    pushed, updated = RobustSpikeDetector(window=5), RobustSpikeDetector(window=5)
    for x in (1.0, 2.0, 3.0, 4.0, 5.0, math.nan):
        pushed.push(x)
        updated.update(x)
    assert pushed.to_state() == updated.to_state()


def test_nan_in_middle_is_flagged_and_skipped():
    xs = list(lognormal_series(200, seed=2))
    with_nan = xs[:40] + [math.nan] + xs[40:]
    det = RobustSpikeDetector(window=10)
    got = [det.update(x) for x in with_nan]
    bad = got[40]
    assert (bad.nonfinite, bad.spike, bad.z, bad.u, bad.direction) == (True, True, None, None, 0)
    clean = RobustSpikeDetector(window=10)
    expected = [clean.update(x) for x in xs]
    assert got[:40] + got[41:] == expected
    ref = reference_scores(with_nan, 10, 10)
    assert got[41].z == pytest.approx(ref[41][2], rel=1e-12)


@pytest.mark.parametrize(
    ("x", "direction"),
    [(math.nan, 0), (math.inf, 1), (-math.inf, -1), (-1.0, -1), (-EPS, -1)],
)
def test_nonfinite_inputs_page_and_stay_out_of_window(x, direction):
    det = RobustSpikeDetector(window=3)
    for v in (1.0, 1.1, 1.2):
        det.update(v)
    r = det.update(x)
    assert (r.nonfinite, r.spike, r.direction) == (True, True, direction)
    assert det.history_len == 3


def test_nonfinite_pages_even_during_warmup():
    r = RobustSpikeDetector(window=10).update(math.nan)
    assert (r.warmup, r.spike, r.nonfinite) == (True, True, True)


def test_state_round_trip_mid_series_reproduces_results():
    xs = lognormal_series(200, seed=3)
    uninterrupted = RobustSpikeDetector(window=30, threshold=4.0)
    expected = [uninterrupted.update(x) for x in xs]
    first = RobustSpikeDetector(window=30, threshold=4.0)
    head = [first.update(x) for x in xs[:117]]
    restored = RobustSpikeDetector.from_state(json.loads(json.dumps(first.to_state())))
    tail = [restored.update(x) for x in xs[117:]]
    assert head + tail == expected
    assert restored.to_state() == uninterrupted.to_state()


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"window": 2}, "window"),
        ({"window": 10, "min_history": 2}, "min_history"),
        ({"window": 10, "min_history": 11}, "min_history"),
        ({"threshold": 0.0}, "threshold"),
        ({"threshold": math.inf}, "threshold"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_detector_config_errors_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        RobustSpikeDetector(**config)


def test_from_state_rejects_overfull_history():
    state = RobustSpikeDetector(window=3).to_state()
    state["history"] = [0.0, 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="history"):
        RobustSpikeDetector.from_state(state)


def test_co_spikes_count_and_magnitude_match_reference():
    rng = np.random.default_rng(4)
    loss = np.exp(rng.normal(1.0, 0.02, size=300))
    grad = np.exp(rng.normal(0.0, 0.05, size=300))
    loss[[100, 150, 250]] *= [2.0, 2.0, 1.0]  # 250: grad-only spike
    grad[[100, 150, 200, 250]] *= [4.0, 4.0, 1.0, 4.0]
    loss[220] = grad[220] = math.nan  # a non-finite co-spike
    loss[230] = math.inf  # loss non-finite alone: no co-spike
    ld, gd = RobustSpikeDetector(window=50), RobustSpikeDetector(window=50)
    tracker = CoSpikeTracker()
    results = [tracker.update(ld.update(a), gd.update(b)) for a, b in zip(loss, grad)]
    ref_l, ref_g = reference_scores(loss, 50, 50), reference_scores(grad, 50, 50)
    flags = np.array([a[3] and b[3] for a, b in zip(ref_l, ref_g)])
    finite = np.array([not (a[4] or b[4]) for a, b in zip(ref_l, ref_g)])
    mags = np.array(
        [min(a[2], b[2]) if f and n else 0.0 for a, b, f, n in zip(ref_l, ref_g, flags, finite)]
    )
    assert [i for i, r in enumerate(results) if r.co_spike] == list(np.flatnonzero(flags))
    assert np.flatnonzero(flags).tolist() == [100, 150, 220]
    last = results[-1]
    assert (last.count, last.nonfinite_count) == (3, 1)
    assert last.cumulative_magnitude == pytest.approx(np.sum(mags), rel=1e-12)
    assert math.isfinite(last.cumulative_magnitude)
    assert results[220].magnitude == 0.0 and results[220].nonfinite


def test_co_spike_state_round_trip():
    tracker = CoSpikeTracker(count=4, nonfinite_count=1, cumulative_magnitude=123.5)
    again = CoSpikeTracker.from_state(json.loads(json.dumps(tracker.to_state())))
    assert again == tracker
    with pytest.raises(ValueError, match="nonfinite_count"):
        CoSpikeTracker(count=1, nonfinite_count=2)


def test_clip_rate_matches_reference_with_warmup_and_restart():
    rng = np.random.default_rng(5)
    g2 = rng.uniform(0.0, 2.0, size=60)
    g2[[7, 33]] = [math.nan, math.inf]
    window, c = 8, 1.0
    clip = ClipRateWindow(window=window, threshold_c=c)
    results = [clip.update(g) for g in g2[:25]]
    clip = ClipRateWindow.from_state(json.loads(json.dumps(clip.to_state())))
    results += [clip.update(g) for g in g2[25:]]
    over = np.isnan(g2) | (g2 > c)  # NaN norms count as clipped
    for t, r in enumerate(results):
        expected = np.mean(over[max(0, t - window + 1) : t + 1])
        assert r.rate == pytest.approx(expected, abs=1e-15)
        assert r.warmup == (t < window - 1)
        assert r.n_steps == min(t + 1, window)


def test_clip_rate_counts_strictly_above_threshold():
    clip = ClipRateWindow(window=4, threshold_c=1.0)
    rates = [clip.update(g).rate for g in (1.0, 1.5, 0.5, 1.0, 2.0)]
    assert rates == [0.0, 0.5, 1 / 3, 0.25, 0.5]


def test_calibrate_is_margin_times_quantile_of_replayed_z():
    xs = np.exp(np.random.default_rng(6).normal(0.0, 0.1, size=400))
    ref_z = np.array([z for _, _, z, _, _ in reference_scores(xs, 40, 40) if z is not None])
    assert ref_z.size == 360
    got = calibrate(xs, window=40, quantile=0.99, margin=1.5)
    assert got == pytest.approx(1.5 * np.quantile(ref_z, 0.99), rel=1e-12)
    top = calibrate(xs, window=40, quantile=1.0, margin=1.0)
    assert top == pytest.approx(ref_z.max(), rel=1e-12)
    det = RobustSpikeDetector(window=40, threshold=got)
    assert sum(det.update(x).spike for x in xs) == 0


@pytest.mark.parametrize(
    ("series", "match"),
    [
        ([1.0, 1.1, 1.2, 1.3, 1.4], "more than window"),
        ([1.0] * 5 + [math.nan] + [1.0] * 10, "series\\[5\\]"),
        ([2.0] * 20, "no spread"),
    ],
)
def test_calibrate_rejects_unusable_series(series, match):
    with pytest.raises(ValueError, match=match):
        calibrate(series, window=5)


def reference_early(xs, window, min_history, early_history, threshold, early_threshold):
    """(z, spike, warmup) per step from explicit windows: scored from ``early_history``
    earlier values on, at ``early_threshold`` against the window's line (slope between the
    halves' medians) until ``min_history`` are there."""
    kept: list[float] = []
    out = []
    for x in np.asarray(xs, dtype=np.float64):
        u = np.log(x + EPS)
        n = len(kept)
        if n < early_history:
            out.append((None, False, True))
        else:
            win = np.array(kept[-window:])
            q = np.median(win)
            d = np.median(np.abs(win - q))
            if n < min_history:  # the early regime: against the window's trend
                h = win.size // 2
                b = (np.median(win[win.size - h :]) - np.median(win[:h])) / (win.size - h)
                r = win - b * np.arange(win.size)
                q, d = np.median(r) + b * win.size, np.median(np.abs(r - np.median(r)))
            z = 0.6745 * abs(u - q) / max(d, FLOOR)
            limit = early_threshold if n < min_history else threshold
            out.append((z, bool(u > q and z > limit), n < min_history))
        kept.append(u)
    return out


def test_the_early_regime_scores_from_a_short_history_against_a_wider_threshold():
    rng = np.random.default_rng(12)
    xs = np.exp(rng.normal(0.0, 0.01, 60)) * np.exp(-np.arange(60) / 20)  # a falling loss
    xs[20] *= 1.3  # a spike at step 20, long before the window (50) is full
    xs[30] *= 1.1  # z between the two thresholds: not an early spike
    det = RobustSpikeDetector(
        window=50, min_history=50, threshold=6.0, early_history=10, early_threshold=12.0
    )
    got = [det.update(x) for x in xs]
    want = reference_early(xs, 50, 50, 10, 6.0, 12.0)
    for r, (z, spike, warmup) in zip(got, want, strict=True):
        assert (r.z is None, r.spike, r.warmup) == (z is None, spike, warmup)
        if z is not None:
            assert r.z == pytest.approx(z, rel=1e-12)
    assert [i for i, r in enumerate(got) if r.spike] == [20]
    assert 6.0 < got[30].z < 12.0 and not got[30].spike
    state = json.loads(json.dumps(det.to_state()))
    assert RobustSpikeDetector.from_state(state).early_threshold == 12.0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"early_history": 2, "early_threshold": 12.0}, "early_history"),
        ({"early_history": 60, "early_threshold": 12.0}, "early_history"),
        ({"early_history": 10}, "early_threshold"),
    ],
)
def test_early_regime_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        RobustSpikeDetector(window=50, **kw)


@pytest.mark.parametrize("n", [2, 3, 10, 11, 37])
def test_the_early_trend_baseline_matches_numpy(n):
    rng = np.random.default_rng(n)
    u = 1.5 - 0.03 * np.arange(n) + rng.normal(0, 0.01, n)
    half = n // 2
    slope = (np.median(u[n - half :]) - np.median(u[:half])) / (n - half)
    r = u - slope * np.arange(n)
    q, d = trend_median_mad(list(u))
    assert q == pytest.approx(np.median(r) + slope * n, rel=1e-12)
    assert d == pytest.approx(np.median(np.abs(r - np.median(r))), rel=1e-12, abs=1e-15)
    line = list(2.0 - 0.1 * np.arange(n))  # exact on a straight line
    assert trend_median_mad(line)[0] == pytest.approx(2.0 - 0.1 * n, rel=1e-12)
