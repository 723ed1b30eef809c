"""The downsampling query (``sinks.downsample``) on the embedded engine against a float64
NumPy reference: per bucket of the window the min, max and last with their steps, NULL,
NaN and ±Inf never a value, a one-step spike kept; the windows' bucket counts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probewire.sinks import ClickHouseSink
from probewire.sinks.downsample import (
    MAX_POINTS,
    POINTS_PER_BUCKET,
    Window,
    downsample_sql,
    points,
    window,
)

RUNS = ("ds-a", "ds-b")


def _reference(
    step: np.ndarray, y: np.ndarray, win: Window, after: float | None = None
) -> dict[int, tuple[float, float, float, float, float, float]]:
    """bucket -> (min, max, last, step of min, step of max, step of last), float64."""
    keep = (step >= win.lo) & (step <= win.hi) & np.isfinite(y)
    if after is not None:
        keep &= step > after
    s, v = step[keep].astype(np.float64), y[keep]
    bucket = np.minimum(np.floor((s - win.lo) / win.width), win.buckets - 1).astype(np.int64)
    out = {}
    for b in np.unique(bucket):
        bs, bv = s[bucket == b], v[bucket == b]
        last = int(np.argmax(bs))
        out[int(b)] = (
            float(bv.min()),
            float(bv.max()),
            float(bv[last]),
            float(bs[np.argmin(bv)]),
            float(bs[np.argmax(bv)]),
            float(bs[last]),
        )
    return out


@pytest.fixture()
def store(ch_client, ch_database):
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    rng = np.random.default_rng(7)
    data = {}
    for i, run in enumerate(RUNS):
        n = 5000 + 1234 * i
        step = np.arange(n, dtype=np.int64)
        loss = rng.normal(3.0, 0.1, n)
        loss[rng.choice(n, 400, replace=False)] = np.nan  # not measured: NULL
        grad = rng.lognormal(0.0, 0.2, n)
        grad[2777] = 1e6  # a one-step spike
        grad[rng.choice(n, 50, replace=False)] = np.inf
        data[run] = (step, loss, grad)
        sink.write_columns(
            "step_metrics",
            {
                "run_id": [run] * n,
                "step": step.tolist(),
                "loss": [None if math.isnan(v) else float(v) for v in loss],
                "grad_norm": grad.tolist(),
            },
        )
    return ch_client, ch_database, data


def _query(client, db, win: Window, *, after: float | None = None, scale=None):
    sql = downsample_sql(
        f"{db}.step_metrics", ["loss", "grad_norm"], live=after is not None, scale=scale
    )
    params = {"runs": list(RUNS), **win.parameters()}
    if after is not None:
        params["after"] = after
    result = client.query(sql, parameters=params)
    return [dict(zip(result.column_names, row)) for row in result.result_rows]


@pytest.mark.parametrize(
    ("lo", "hi", "after"), [(0, 6233, None), (1000, 3000.5, None), (0, 6233, 5990.0)]
)
def test_buckets_match_numpy(store, lo, hi, after):
    client, db, data = store
    win = window(lo, hi, integer=True)
    rows = _query(client, db, win, after=after)
    for run in RUNS:
        step, loss, grad = data[run]
        got = {r["bucket"]: r for r in rows if r["run_id"] == run}
        for column, y in (("loss", loss), ("grad_norm", grad)):
            ref = _reference(step, y, win, after)
            with_values = {b for b, r in got.items() if r[f"{column}__n"]}
            assert with_values == set(ref)
            for b, expected in ref.items():
                row = got[b]
                actual = tuple(
                    float(row[f"{column}__{p}"])
                    for p in ("min", "max", "last", "xmin", "xmax", "xlast")
                )
                np.testing.assert_allclose(actual, expected, rtol=0, atol=0)


def test_spike_kept_and_points_bounded(store):
    client, db, data = store
    win = window(0, 6233, integer=True)
    rows = [r for r in _query(client, db, win) if r["run_id"] == RUNS[0]]
    drawn = [p for r in rows for p in points(r, "grad_norm")]
    assert len(rows) <= MAX_POINTS // POINTS_PER_BUCKET
    assert len(drawn) <= MAX_POINTS
    assert (2777.0, 1e6) in drawn  # the spike at its own step
    xs = [x for x, _ in drawn]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)


def test_scale_divides_before_aggregating(store):
    client, db, data = store
    win = window(0, 6233, integer=True)
    plain = _query(client, db, win)
    scaled = _query(client, db, win, scale=[1.0, 1024.0])
    for a, b in zip(plain, scaled):
        if a["grad_norm__n"]:
            assert b["grad_norm__max"] == pytest.approx(a["grad_norm__max"] / 1024.0, rel=1e-15)
            assert b["grad_norm__xmax"] == a["grad_norm__xmax"]


def test_window_bucket_counts():
    assert window(0, 199_999, integer=True).width == math.ceil(200_000 / 666)
    assert window(0, 10, integer=True).width == 1.0  # a short range keeps every step
    w = window(0.0, 3e12, integer=False)
    assert w.width == pytest.approx(3e12 / 666)
    assert w.buckets * POINTS_PER_BUCKET <= MAX_POINTS
    with pytest.raises(ValueError):
        window(5, 1, integer=True)
    with pytest.raises(ValueError):
        window(0, math.inf, integer=False)


def test_names_are_checked():
    with pytest.raises(ValueError):
        downsample_sql("db.step_metrics", ["loss; DROP TABLE x"])
    with pytest.raises(ValueError):
        downsample_sql("db.step_metrics", ["loss"], x="step)")
