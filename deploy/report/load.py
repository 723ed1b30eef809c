"""What a report draws, read from the store: one run's first screen and its context.

Pure reads (``client.query`` with the run id bound as a parameter); no drawing here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "EvalSeries",
    "FirstScreenData",
    "RunNotFound",
    "load_first_screen",
    "load_runs",
    "source_shares",
]


class RunNotFound(LookupError):
    """The store holds no step of this run."""


@dataclass(frozen=True, slots=True)
class EvalSeries:
    """One evaluation curve: a suite's metric on one weight stream, at checkpoint steps."""

    suite: str
    metric: str
    stream: str
    reference: bool
    step: np.ndarray
    tokens: np.ndarray
    flops: np.ndarray
    value: np.ndarray

    @property
    def name(self) -> str:
        return f"{self.suite} {self.metric} ({self.stream})"


@dataclass(slots=True)
class FirstScreenData:
    """What the panels and the tables need, read from the store.

    ``sources`` maps a source to (step, loss, source tokens) per step; ``users`` a user
    metric's name (``user_metrics``) to (its reduction, step, value).
    """

    run_id: str
    run: dict[str, Any] | None
    steps: dict[str, np.ndarray]  # first_screen columns
    sources: dict[str, tuple[np.ndarray, ...]]  # step, loss, tokens
    evals: list[EvalSeries] = field(default_factory=list)
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    users: dict[str, tuple[str, np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def config(self) -> dict[str, Any]:
        """The run configuration (``runs.config``), {} when absent or not JSON."""
        text = (self.run or {}).get("config") or "{}"
        try:
            value = json.loads(text)
        except ValueError:
            return {"config": text}
        return value if isinstance(value, dict) else {"config": value}


def source_shares(
    sources: dict[str, tuple[np.ndarray, ...]],
) -> dict[str, float]:
    """Each source's share of the run's valid tokens: its tokens summed over the stored
    steps over all sources' tokens (NaN when no source counted a token)."""
    totals = {s: float(np.nansum(tokens)) for s, (_, _, tokens) in sources.items()}
    whole = sum(totals.values())
    return {s: (t / whole if whole > 0 else float("nan")) for s, t in totals.items()}


def _query(client: Any, sql: str, run_id: str) -> tuple[list[str], list[tuple]]:
    result = client.query(sql, parameters={"run": run_id})
    return list(result.column_names), list(result.result_rows)


def _dicts(client: Any, sql: str, run_id: str) -> list[dict[str, Any]]:
    names, rows = _query(client, sql, run_id)
    return [dict(zip(names, row)) for row in rows]


def _floats(values: list[Any]) -> np.ndarray:
    return np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)


def load_first_screen(client: Any, database: str, run_id: str) -> FirstScreenData:
    """Read one run's first screen; ``RunNotFound`` names the runs that do exist."""
    db = database
    names, rows = _query(
        client,
        f"SELECT * FROM {db}.first_screen WHERE run_id = {{run:String}} ORDER BY step",
        run_id,
    )
    if not rows:
        known = [
            r[0]
            for r in client.query(
                f"SELECT run_id FROM {db}.step_metrics GROUP BY run_id "
                "ORDER BY max(inserted_at) DESC LIMIT 10"
            ).result_rows
        ]
        hint = f"; runs in {db}: {', '.join(known)}" if known else f"; {db} holds no run yet"
        raise RunNotFound(f"run {run_id!r} has no steps in {db}.step_metrics{hint}")
    steps = {  # the numeric series (a map column, such as pi per modality, is not drawn)
        name: _floats([r[i] for r in rows])
        for i, name in enumerate(names)
        if name != "run_id" and not isinstance(rows[0][i], dict)
    }
    runs = _dicts(client, f"SELECT * FROM {db}.runs FINAL WHERE run_id = {{run:String}}", run_id)
    by_source: dict[str, list[tuple]] = {}
    for row in _query(
        client,
        f"SELECT source, step, loss, source_tokens FROM "
        f"{db}.loss_by_source WHERE run_id = {{run:String}} "
        "ORDER BY source, step",
        run_id,
    )[1]:
        by_source.setdefault(row[0], []).append(row[1:])
    sources = {
        source: tuple(_floats(list(col)) for col in zip(*values))
        for source, values in by_source.items()
    }
    evals = _evals(client, db, run_id)
    anomalies = _dicts(
        client,
        f"""
        SELECT a.step AS step, s.tokens AS tokens, s.flops AS flops, a.signal AS signal,
               a.kind AS kind, a.value AS value, a.baseline AS baseline, a.z AS z,
               a.culprit AS culprit
        FROM (SELECT * FROM {db}.anomalies FINAL WHERE run_id = {{run:String}}) AS a
        LEFT JOIN (SELECT step, tokens, flops FROM {db}.step_metrics FINAL
                   WHERE run_id = {{run:String}}) AS s ON a.step = s.step
        ORDER BY a.step, a.signal, a.kind""",
        run_id,
    )
    alerts = _dicts(
        client,
        f"""
        SELECT a.step AS step, a.tokens AS tokens, s.flops AS flops, a.signal AS signal,
               a.severity AS severity, a.value AS value, a.baseline AS baseline, a.z AS z,
               a.culprit AS culprit, a.ranks AS ranks, a.message AS message,
               a.next_steps AS next_steps, a.fired_at AS fired_at
        FROM (SELECT * FROM {db}.alerts FINAL WHERE run_id = {{run:String}}) AS a
        LEFT JOIN (SELECT step, flops FROM {db}.step_metrics FINAL
                   WHERE run_id = {{run:String}}) AS s ON a.step = s.step
        ORDER BY a.step, a.signal""",
        run_id,
    )
    return FirstScreenData(
        run_id,
        runs[0] if runs else None,
        steps,
        sources,
        evals,
        anomalies,
        alerts,
        _user_metrics(client, db, run_id),
    )


def _evals(client: Any, db: str, run_id: str) -> list[EvalSeries]:
    """The run's evaluation curves, one per suite, metric, weight stream and reference."""
    by_eval: dict[tuple[str, str, str, int], list[tuple]] = {}
    for suite, metric, stream, reference, *point in _query(
        client,
        f"SELECT suite, metric, weights_stream, reference, step, tokens, flops, "
        f"value FROM {db}.evaluations FINAL WHERE run_id = {{run:String}} "
        "ORDER BY suite, metric, weights_stream, step",
        run_id,
    )[1]:
        by_eval.setdefault((suite, metric, stream, reference), []).append(tuple(point))
    return [
        EvalSeries(
            suite, metric, stream, bool(reference), *(_floats(list(col)) for col in zip(*points))
        )
        for (suite, metric, stream, reference), points in by_eval.items()
    ]


def _user_metrics(
    client: Any, db: str, run_id: str
) -> dict[str, tuple[str, np.ndarray, np.ndarray]]:
    """The run's user metrics: name -> (reduction, step, value), steps in order."""
    by_name: dict[str, list[tuple]] = {}
    for name, reduction, step, value in _query(
        client,
        f"SELECT name, reduction, step, value FROM {db}.user_metrics FINAL "
        "WHERE run_id = {run:String} ORDER BY name, step",
        run_id,
    )[1]:
        by_name.setdefault(name, []).append((reduction, step, value))
    return {
        name: (rows[-1][0], _floats([r[1] for r in rows]), _floats([r[2] for r in rows]))
        for name, rows in by_name.items()
    }


def load_runs(client: Any, database: str, run_ids: list[str]) -> list[FirstScreenData]:
    """Several runs, in the order given; a repeated run id is a user mistake."""
    if not run_ids:
        raise ValueError("name at least one --run")
    repeated = sorted({r for r in run_ids if run_ids.count(r) > 1})
    if repeated:
        raise ValueError(f"run {repeated[0]!r} is named twice")
    return [load_first_screen(client, database, run_id) for run_id in run_ids]
