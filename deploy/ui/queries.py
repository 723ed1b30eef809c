"""What the web UI reads: pure reads of the store, run ids and ranges bound as parameters.

Every chart's series is read downsampled in SQL (``sinks.downsample``): per bucket of the
visible x range its min, max and last, so a panel of any run length returns at most
``MAX_POINTS`` points and a one-step spike stays drawn. The charts and their series are
the registry's (``stream.series.CHARTS`` / ``chart_columns``); loss by source and the
evaluations are long tables, one series per source or per suite and metric. A user's own
metrics (``Monitor.log``, the long ``user_metrics`` table) are one panel per name
(``user:NAME``), their specs (title with the declared reduction) in ``user_panels``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from probewire.sinks.downsample import MAX_POINTS, Window, downsample_sql, points, window
from probewire.stream.series import CHARTS, chart_columns

__all__ = [
    "AXES",
    "ChartSeries",
    "anomalies",
    "chart_data",
    "extent",
    "pages",
    "run_status",
    "runs",
    "step_rows",
    "user_panels",
]

_NO_END, _NO_END_BUCKETS = 1e300, 1 << 62  # a live update's window: open to the right
AXES = {"step": "step", "tokens": "cumulative tokens", "flops": "cumulative FLOPs"}


def _rows(client: Any, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    result = client.query(sql, parameters=params or {})
    names = list(result.column_names)
    return [dict(zip(names, row)) for row in result.result_rows]


def _tags(config: str) -> list[str]:
    """The run's tags: the ``tags`` list of its configuration (``attach(run_config=...)``)."""
    try:
        value = json.loads(config or "{}")
    except ValueError:
        return []
    tags = value.get("tags") if isinstance(value, dict) else None
    return [str(t) for t in tags] if isinstance(tags, list) else []


def runs(client: Any, db: str) -> list[dict[str, Any]]:
    """One row per run: status, world size, steps, tokens, last loss, pages, anomalies, the
    note and tags a user set (``user_tags``), ``tags`` the config's and those together."""
    rows = _rows(
        client,
        f"""
        SELECT r.run_id AS run_id, r.status AS status, r.world_size AS world_size,
               s.steps AS steps, s.last_step AS last_step, s.tokens AS tokens,
               s.loss AS loss, p.pages AS pages, a.anomalies AS anomalies,
               r.updated_at AS updated_at, r.config AS config, r.note AS note,
               r.tags AS user_tags
        FROM (SELECT * FROM {db}.runs FINAL) AS r
        LEFT JOIN (SELECT run_id, uniqExact(step) AS steps, max(step) AS last_step,
                          max(tokens) AS tokens, argMaxIf(loss, step, isNotNull(loss)) AS loss
                   FROM {db}.step_metrics GROUP BY run_id) AS s ON r.run_id = s.run_id
        LEFT JOIN (SELECT run_id, countIf(severity = 'page') AS pages
                   FROM {db}.alerts FINAL GROUP BY run_id) AS p ON r.run_id = p.run_id
        LEFT JOIN (SELECT run_id, count() AS anomalies
                   FROM {db}.anomalies FINAL GROUP BY run_id) AS a ON r.run_id = a.run_id
        ORDER BY r.updated_at DESC, r.run_id""",
    )
    for row in rows:
        row["user_tags"] = list(row["user_tags"])
        row["tags"] = list(dict.fromkeys([*_tags(row.pop("config")), *row["user_tags"]]))
    return rows


def run_status(client: Any, db: str, run_id: str) -> str | None:
    """The run's status (None: no such run)."""
    rows = _rows(
        client,
        f"SELECT status FROM {db}.runs FINAL WHERE run_id = {{run:String}}",
        {"run": run_id},
    )
    return rows[0]["status"] if rows else None


def extent(client: Any, db: str, run_ids: list[str], x: str) -> tuple[float, float] | None:
    """The x range the runs' steps cover (None: no step stored)."""
    row = _rows(
        client,
        f"SELECT min({x}) AS lo, max({x}) AS hi, count() AS n FROM {db}.step_metrics "
        "WHERE run_id IN {runs:Array(String)}",
        {"runs": run_ids},
    )[0]
    return None if not row["n"] else (float(row["lo"]), float(row["hi"]))


@dataclass(frozen=True, slots=True)
class ChartSeries:
    """One line: a run's series on one chart, as downsampled points."""

    run_id: str
    label: str
    x: list[float]
    y: list[float]


_SOURCE_SQL = """SELECT run_id, step, source, loss FROM {db}.source_metrics FINAL
    WHERE run_id IN {{runs:Array(String)}}"""
# on a tokens or FLOPs axis, each source step's x from its step_metrics row (only those rows)
_SOURCE_ON_X_SQL = """SELECT s.run_id AS run_id, s.step AS step, m.tokens AS tokens,
    m.flops AS flops, s.source AS source, s.loss AS loss
    FROM (SELECT run_id, step, source, loss FROM {db}.source_metrics FINAL
          WHERE run_id IN {{runs:Array(String)}}) AS s
    INNER JOIN (SELECT run_id, step, tokens, flops FROM {db}.step_metrics
                WHERE run_id IN {{runs:Array(String)}} AND (run_id, step) IN (
                    SELECT run_id, step FROM {db}.source_metrics
                    WHERE run_id IN {{runs:Array(String)}})) AS m
    ON s.run_id = m.run_id AND s.step = m.step"""

_EVAL_SQL = """SELECT run_id, step, toFloat64(tokens) AS tokens, flops, suite, metric,
    weights_stream, value FROM {db}.evaluations FINAL WHERE run_id IN {{runs:Array(String)}}"""


_USER_SQL = """SELECT run_id, step, name, value FROM {db}.user_metrics FINAL
    WHERE run_id IN {{runs:Array(String)}}"""
# on a tokens or FLOPs axis, each user metric's step at its step_metrics row's x
_USER_ON_X_SQL = """SELECT u.run_id AS run_id, u.step AS step, m.tokens AS tokens,
    m.flops AS flops, u.name AS name, u.value AS value
    FROM (SELECT run_id, step, name, value FROM {db}.user_metrics FINAL
          WHERE run_id IN {{runs:Array(String)}}) AS u
    INNER JOIN (SELECT run_id, step, tokens, flops FROM {db}.step_metrics
                WHERE run_id IN {{runs:Array(String)}}) AS m
    ON u.run_id = m.run_id AND u.step = m.step"""

_LONG = {  # the charts read from a long table: (query, value column, series expression)
    "source": (_SOURCE_SQL, "loss", "source"),
    "eval": (_EVAL_SQL, "value", "concat(suite, ' ', metric, ' (', weights_stream, ')')"),
    "user": (_USER_SQL, "value", "name"),  # split: one panel per name (USER_PREFIX + name)
}
_ON_X = {"source": _SOURCE_ON_X_SQL, "user": _USER_ON_X_SQL}  # a long table's on tokens/FLOPs
USER_PREFIX = "user:"


def _lines(
    rows: list[dict[str, Any]], columns: list[tuple[str, str]]
) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
    """(run, label) -> (x, y) of the points of each (column, label) in the bucket rows; a
    row's ``series`` (a long table's) is the label."""
    lines: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for row in rows:
        for column, label in columns:
            drawn = points(row, column)
            if not drawn:
                continue
            xs, ys = lines.setdefault((row["run_id"], str(row.get("series", label))), ([], []))
            for px, py in drawn:
                xs.append(px)
                ys.append(py)
    return lines


def _read_charts(
    client: Any, db: str, run_ids: list[str], x: str, win: Window, after: float | None
) -> dict[str, list[ChartSeries]]:
    """Every chart's lines: the step_metrics charts in one downsampled query (one scan of
    the runs' rows), each long-table chart in one of its own."""
    params: dict[str, Any] = {"runs": run_ids, **win.parameters()}
    if after is not None:
        params["after"] = after
    live = after is not None
    wide = {c.key: list(chart_columns(c)) for c in CHARTS if c.key not in _LONG}
    columns = [col for pairs in wide.values() for col, _ in pairs]
    scales = [c.scale for c in CHARTS if c.key in wide for _ in wide[c.key]]
    rows = _rows(
        client,
        downsample_sql(f"{db}.step_metrics", columns, x=x, live=live, final=False, scale=scales),
        params,
    )
    out = {}
    for key, pairs in wide.items():
        out[key] = [ChartSeries(r, lb, xs, ys) for (r, lb), (xs, ys) in _lines(rows, pairs).items()]
    for key, (sql, column, group) in _LONG.items():
        if key in _ON_X and x != "step":
            sql = _ON_X[key]
        long_rows = _rows(
            client,
            downsample_sql("t", [column], x=x, live=live, group=group, subquery=sql.format(db=db)),
            params,
        )
        lines = _lines(long_rows, [(column, column)])
        for (r, lb), (xs, ys) in lines.items():
            panel = USER_PREFIX + lb if key == "user" else key
            out.setdefault(panel, []).append(ChartSeries(r, lb, xs, ys))
        out.setdefault(key, [])
    out.pop("user")
    return out


def user_panels(client: Any, db: str, run_ids: list[str]) -> list[dict[str, Any]]:
    """One panel spec per name the runs logged (``Monitor.log``), in name order: its title
    carries the reduction over ranks the script declared (each one, if runs differ)."""
    rows = _rows(
        client,
        f"SELECT name, arraySort(groupUniqArray(reduction)) AS reductions "
        f"FROM {db}.user_metrics WHERE run_id IN {{runs:Array(String)}} "
        "GROUP BY name ORDER BY name",
        {"runs": run_ids},
    )
    return [
        {
            "key": USER_PREFIX + r["name"],
            "title": f"{r['name']} (your metric; {', '.join(r['reductions'])} over ranks)",
            "unit": "as logged",
            "log": False,
            "count": False,
            "smooth": True,
            "signals": [],
        }
        for r in rows
    ]


def chart_data(
    client: Any,
    db: str,
    run_ids: list[str],
    x: str = "step",
    lo: float | None = None,
    hi: float | None = None,
    after: float | None = None,
    width: float | None = None,
) -> dict[str, Any]:
    """Every chart's lines for the runs over ``[lo, hi]`` (default: all their steps).

    A live update (``after`` and ``width``, ``lo`` the origin of the buckets drawn): the
    steps after ``after`` in buckets of that width, as many as there are."""
    if x not in AXES:
        raise ValueError(f"x must be one of {', '.join(AXES)}, got {x!r}")
    full = extent(client, db, run_ids, x)
    if full is None:
        return {"x": x, "last_step": None, "window": None, "charts": {}, "user_panels": []}
    if after is not None:
        if width is None or lo is None or not width > 0:
            raise ValueError("a live update (after) needs lo and a positive width")
        win = Window(lo, _NO_END, width, _NO_END_BUCKETS)
    else:
        win = window(
            full[0] if lo is None else lo, full[1] if hi is None else hi, integer=x == "step"
        )
    charts = {
        key: [{"run": s.run_id, "label": s.label, "x": s.x, "y": s.y} for s in lines]
        for key, lines in _read_charts(client, db, run_ids, x, win, after).items()
    }
    last = full[1] if x == "step" else (extent(client, db, run_ids, "step") or full)[1]
    return {
        "x": x,
        "last_step": int(last),
        "window": {"lo": win.lo, "hi": win.hi, "width": win.width, "full": list(full)},
        "max_points": MAX_POINTS,
        "charts": charts,
        "user_panels": user_panels(client, db, run_ids),
    }


def anomalies(client: Any, db: str, run_ids: list[str]) -> list[dict[str, Any]]:
    """The runs' anomalies, with each step's tokens and FLOPs (to mark any x axis)."""
    return _rows(
        client,
        f"""
        SELECT a.run_id AS run_id, a.step AS step, s.tokens AS tokens, s.flops AS flops,
               a.signal AS signal, a.kind AS kind, a.value AS value, a.z AS z,
               a.culprit AS culprit
        FROM (SELECT * FROM {db}.anomalies FINAL WHERE run_id IN {{runs:Array(String)}}) AS a
        LEFT JOIN (SELECT run_id, step, tokens, flops FROM {db}.step_metrics
                   WHERE run_id IN {{runs:Array(String)}}) AS s
        ON a.run_id = s.run_id AND a.step = s.step
        ORDER BY a.run_id, a.step, a.signal""",
        {"runs": run_ids},
    )


def pages(client: Any, db: str, run_ids: list[str]) -> list[dict[str, Any]]:
    """The runs' pages and warnings (alerts), with each step's tokens and FLOPs."""
    return _rows(
        client,
        f"""
        SELECT a.run_id AS run_id, a.step AS step, s.tokens AS tokens, s.flops AS flops,
               a.signal AS signal, a.severity AS severity, a.message AS message,
               a.culprit AS culprit
        FROM (SELECT * FROM {db}.alerts FINAL WHERE run_id IN {{runs:Array(String)}}) AS a
        LEFT JOIN (SELECT run_id, step, tokens, flops FROM {db}.step_metrics
                   WHERE run_id IN {{runs:Array(String)}}) AS s
        ON a.run_id = s.run_id AND a.step = s.step
        ORDER BY a.run_id, a.step, a.signal""",
        {"runs": run_ids},
    )


def step_rows(client: Any, db: str, run_id: str, step: int) -> dict[str, list[dict[str, Any]]]:
    """A retained step's detail: per-rank rows, per-tensor rows (``tensor_view``) and the
    depth profiles: RMS per layer of ``tensor_view`` and R_b per layer and branch
    (``residual_stats``) when the step holds them."""
    p = {"run": run_id, "step": step}
    return {
        "ranks": _rows(
            client,
            f"SELECT rank, metric, labels, value, late FROM {db}.rank_metrics FINAL "
            "WHERE run_id = {run:String} AND step = {step:UInt64} "
            "ORDER BY metric, labels, rank LIMIT 2000",
            p,
        ),
        "tensors": _rows(
            client,
            f"SELECT tensor, kind, n, abs_max, rms, abs_mean, zero_frac, nonfinite, "
            f"excess_kurtosis FROM {db}.tensor_view "
            "WHERE run_id = {run:String} AND step = {step:UInt64} "
            "ORDER BY kind, tensor LIMIT 2000",
            p,
        ),
        "depth": _depth(client, db, p),
        "residual": _rows(
            client,
            f"SELECT toInt32OrNull(layer) AS layer, branch, ratio, stream_norm, branch_norm "
            f"FROM {db}.residual_stats FINAL "
            "WHERE run_id = {run:String} AND step = {step:UInt64} ORDER BY layer, branch",
            p,
        ),
    }


def _depth(client: Any, db: str, p: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layer: the RMS of the block outputs (fwd) and of the gradients (grad)."""
    return _rows(
        client,
        f"""
        SELECT n.layer AS layer, v.kind AS kind, avg(v.rms) AS rms, max(v.abs_max) AS abs_max
        FROM (SELECT tensor, kind, rms, abs_max FROM {db}.tensor_view
              WHERE run_id = {{run:String}} AND step = {{step:UInt64}}) AS v
        INNER JOIN (SELECT tensor, layer FROM {db}.tensor_names FINAL
                    WHERE run_id = {{run:String}} AND layer IS NOT NULL) AS n
        ON v.tensor = n.tensor
        GROUP BY layer, kind ORDER BY kind, layer""",
        p,
    )
