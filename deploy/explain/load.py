"""Everything ``probewire explain`` reads from the store for one step, in a few queries.

The loader only reads (it never migrates): a store of an older schema lacks some columns,
and those signals read as not measured. Scoring (``score``) works on what this returns and
touches no store."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from probewire.instrument.catalog import Comm, System

from .model import StepNotFound

__all__ = ["Loaded", "StepData", "load"]


@dataclass(slots=True)
class StepData:
    """step_metrics rows of the scanned stretch and its history, column by column."""

    steps: np.ndarray
    cols: dict[str, list[Any]]

    def column(self, name: str) -> list[Any]:
        """A step_metrics column; one a store of an older schema lacks reads as not measured
        (explain reads, it never migrates)."""
        return self.cols.get(name) or [None] * self.steps.size

    def series(self, name: str) -> np.ndarray:
        """Values as floats; absent (not measured) is NaN, see ``present``."""
        return np.array([np.nan if v is None else float(v) for v in self.column(name)])

    def present(self, name: str) -> np.ndarray:
        return np.array([v is not None for v in self.column(name)], dtype=bool)

    def at(self, name: str, step: int) -> Any:
        return self.column(name)[int(np.flatnonzero(self.steps == step)[0])]


@dataclass(slots=True)
class Loaded:
    """One step's evidence: the P0 series around it and the detail the walk opens."""

    run_id: str
    step: int
    start: int  # first scanned step
    data: StepData
    late: list[tuple[int, list[int]]] = field(default_factory=list)  # (step, late ranks)
    sources: list[tuple[str, int, float]] = field(default_factory=list)  # (source, step, L)
    step_times: dict[int, float] = field(default_factory=dict)  # per rank, at the step
    waits: dict[int, float] = field(default_factory=dict)  # per rank, at the step
    tensor_kind: str | None = None  # bwd, else grad
    tensor_steps: list[int] = field(default_factory=list)
    tensors: list[tuple[str, int, float]] = field(default_factory=list)  # (tensor, step, |x|max)
    moe: tuple | None = None  # (step, layer, MaxVio, busiest expert, H)
    alerts: list[dict[str, Any]] = field(default_factory=list)  # page records at the step
    episode_events: list[dict[str, Any]] = field(default_factory=list)


def _rows(client: Any, sql: str, params: dict[str, Any]) -> tuple[list[str], list[tuple]]:
    result = client.query(sql, parameters=params)
    return list(result.column_names), list(result.result_rows)


def _dicts(client: Any, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    names, rows = _rows(client, sql, params)
    return [dict(zip(names, row)) for row in rows]


def load(
    client: Any, db: str, run_id: str, step: int, *, window: int, lookback: int, layer_history: int
) -> Loaded:
    """Read step ``step`` of ``run_id``: ``window`` history steps before the ``lookback``
    scanned ones, and the detail at the step (StepNotFound when it is not stored)."""
    p = {"run": run_id, "lo": max(step - lookback - window, 0), "hi": step}
    names, rows = _rows(
        client,
        f"SELECT * FROM {db}.step_metrics FINAL WHERE run_id = "
        "{run:String} AND step BETWEEN {lo:UInt64} AND {hi:UInt64} "
        "ORDER BY step",
        p,
    )
    if not rows or rows[-1][names.index("step")] != step:
        span = client.query(
            f"SELECT min(step), max(step), count() FROM {db}.step_metrics "
            "WHERE run_id = {run:String}",
            parameters=p,
        ).result_rows[0]
        where = f"it has steps {span[0]}–{span[1]}" if span[2] else "no such run"
        raise StepNotFound(f"step {step} of run {run_id!r} is not in {db}.step_metrics ({where})")
    data = StepData(
        np.array([r[names.index("step")] for r in rows]),
        {n: [r[i] for r in rows] for i, n in enumerate(names)},
    )
    start = max(step - lookback, int(data.steps[0]))
    out = Loaded(run_id, step, start, data)
    _load_ranks(client, db, p, start, out)
    _load_tensors(client, db, run_id, step, layer_history, out)
    _load_pages(client, db, p, start, out)
    return out


def _load_ranks(client: Any, db: str, p: dict[str, Any], start: int, out: Loaded) -> None:
    """The late ranks of the scanned steps, the sources' losses, and each rank's step time
    and collective wait at the step."""
    run_id, step = out.run_id, out.step
    out.late = [
        (int(s), sorted(int(r) for r in ranks))
        for s, ranks in _rows(
            client,
            f"SELECT step, groupUniqArray(rank) FROM {db}.rank_metrics FINAL WHERE run_id "
            "= {run:String} AND late = 1 AND step BETWEEN {lo:UInt64} AND {hi:UInt64} "
            "GROUP BY step ORDER BY step",
            p | {"lo": start},
        )[1]
    ]
    out.sources = [
        (str(src), int(s), float(v))
        for src, s, v in _rows(
            client,
            f"SELECT source, step, loss FROM {db}.source_metrics FINAL WHERE run_id = "
            "{run:String} AND step BETWEEN {lo:UInt64} AND {hi:UInt64} "
            "ORDER BY source, step",
            p,
        )[1]
    ]
    for rank, metric, value in _rows(
        client,
        f"SELECT rank, metric, value FROM {db}.rank_metrics FINAL WHERE run_id = "
        "{run:String} AND step = {s:UInt64} AND metric IN ({t:String}, {w:String}) "
        "ORDER BY rank",
        {"run": run_id, "s": step, "t": System.STEP_TIME, "w": Comm.WAIT},
    )[1]:
        if metric == System.STEP_TIME:
            out.step_times[int(rank)] = float(value)
        elif np.isfinite(value):
            out.waits[int(rank)] = out.waits.get(int(rank), 0.0) + float(value)


def _load_pages(client: Any, db: str, p: dict[str, Any], start: int, out: Loaded) -> None:
    """The worst expert layer of the scanned steps, the step's pages, and the events at the
    step inside a page episode that opened earlier."""
    moe = _rows(
        client,
        f"SELECT step, layer, max_violation, busiest_expert, h_norm FROM "
        f"{db}.expert_balance WHERE run_id = {{run:String}} AND step <= "
        "{hi:UInt64} AND step >= {lo:UInt64} ORDER BY step DESC, "
        "max_violation DESC LIMIT 1",
        p | {"lo": start},
    )[1]
    out.moe = moe[0] if moe else None
    out.alerts = _dicts(
        client,
        f"SELECT signal, culprit, value, baseline, z, message FROM "
        f"{db}.alerts FINAL WHERE run_id = {{run:String}} AND step = "
        "{hi:UInt64}",
        p,
    )
    # events at the step inside an open page episode: an anomaly of a signal (and culprit)
    # that paged at an earlier step of the history window
    out.episode_events = _dicts(
        client,
        f"SELECT a.signal AS signal, a.culprit AS culprit, a.kind AS kind, "
        f"a.value AS value, a.baseline AS baseline, a.z AS z, p.page_step AS "
        f"page_step, p.message AS message FROM (SELECT * FROM {db}.anomalies FINAL "
        "WHERE run_id = {run:String} AND step = {hi:UInt64}) AS a INNER JOIN (SELECT "
        f"signal, culprit, max(step) AS page_step, argMax(message, step) AS message FROM "
        f"{db}.alerts FINAL WHERE run_id = {{run:String}} AND step < {{hi:UInt64}} "
        "AND step >= {lo:UInt64} GROUP BY signal, culprit) AS p ON a.signal = "
        "p.signal AND a.culprit = p.culprit ORDER BY a.signal",
        p,
    )


def _load_tensors(client: Any, db: str, run_id: str, step: int, history: int, out: Loaded) -> None:
    """Backward |g|max per tensor on the last ``history`` + 1 tensor-probe steps up to
    ``step`` (kind bwd where the run has it, else grad), for the layer walk."""
    p = {"run": run_id, "hi": step}
    kinds = _rows(
        client,
        f"SELECT kind, max(step) FROM {db}.tensor_stats FINAL WHERE run_id = "
        "{run:String} AND kind IN ('bwd', 'grad') AND step <= {hi:UInt64} "
        "GROUP BY kind ORDER BY kind",
        p,
    )[1]
    if not kinds:
        return
    kind = "bwd" if any(k == "bwd" for k, _ in kinds) else "grad"
    steps = [
        int(r[0])
        for r in _rows(
            client,
            f"SELECT DISTINCT step FROM {db}.tensor_stats WHERE run_id = {{run:String}} "
            "AND kind = {k:String} AND step <= {hi:UInt64} ORDER BY step DESC "
            "LIMIT {n:UInt32}",
            p | {"k": kind, "n": history + 1},
        )[1]
    ]
    out.tensor_kind, out.tensor_steps = kind, steps
    out.tensors = [
        (str(t), int(s), float(v))
        for t, s, v in _rows(
            client,
            f"SELECT tensor, step, abs_max FROM {db}.tensor_stats FINAL WHERE run_id = "
            "{run:String} AND kind = {k:String} AND step IN {s:Array(UInt64)}",
            p | {"k": kind, "s": steps},
        )[1]
    ]
