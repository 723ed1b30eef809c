"""``probewire report``: the first screen of one run as a PNG and a self-contained HTML page.

Nine panels, one per P0 signal of the first screen (seeds 001 §1), drawn from the
``first_screen`` and ``loss_by_source`` views and the ``evaluations`` table: raw values,
never smoothed, against cumulative tokens (runs are compared by tokens, not steps).
Anomalies from the ``anomalies`` table are red triangles on the panel of their signal;
pages from the ``alerts`` table are dashed red lines across every panel. The HTML page
embeds the PNG (base64) and lists the alerts and anomalies.
"""

from __future__ import annotations

import base64
import html
import io
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

__all__ = ["PANELS", "FirstScreenData", "Panel", "RunNotFound", "load_first_screen",
           "render_first_screen", "write_report"]

_GIB = float(1 << 30)


class RunNotFound(LookupError):
    """The store holds no step of this run."""


@dataclass(frozen=True, slots=True)
class Panel:
    """One of the nine panels: the first_screen columns it plots and the signals it marks.

    ``right`` columns go on a second y axis; ``scale`` divides values for display.
    """

    key: str
    title: str
    ylabel: str
    columns: tuple[tuple[str, str], ...] = ()       # (column, legend label)
    right: tuple[tuple[str, str], ...] = ()
    right_label: str = ""
    signals: frozenset[str] = frozenset()
    log: bool = False
    scale: float = 1.0


PANELS: tuple[Panel, ...] = (
    Panel("loss", "Loss: mean L and worst rank L_max", "nats/token",
          (("loss", "L"), ("loss_worst_rank", "L_max")),
          signals=frozenset({"loss", "loss_worst_rank"})),
    Panel("source", "Loss by source (own history)", "nats/token",
          signals=frozenset({"loss_by_source"})),
    Panel("grad", "Gradient norm G2 and clip rate", "G2 (pre-clip)",
          (("grad_norm", "G2"),), (("clip_rate", "clip rate"),), "clip rate",
          frozenset({"grad_norm", "clip_rate"}), log=True),
    Panel("cospike", "Co-spikes (cumulative)", "count",
          (("cospike_count", "co-spikes"),), signals=frozenset({"cospike"})),
    Panel("time", "Step time and throughput", "step time (s)",
          (("step_time_s", "step time"),), (("tokens_per_s", "tokens/s"),), "tokens/s",
          frozenset({"step_time", "step_time_s", "tokens_per_s", "straggler_score",
                     "compute_rate"})),
    Panel("memory", "Peak memory, max over ranks", "GiB",
          (("peak_memory_bytes", "peak"),),
          signals=frozenset({"peak_memory", "peak_memory_bytes"}),
          scale=_GIB),
    Panel("experts", "Expert balance: MaxVio", "MaxVio",
          (("moe_maxvio", "MaxVio (worst layer)"),),
          signals=frozenset({"moe_maxvio", "moe_shard_imbalance", "moe_h_norm"})),
    Panel("output", "Output |x|max", "|x|max",
          (("output_absmax", "|x|max"),), signals=frozenset({"output_absmax"}), log=True),
    Panel("eval", "Held-out bits per byte", "bits/byte", signals=frozenset({"bpb"})),
)


@dataclass(slots=True)
class FirstScreenData:
    """What the nine panels and the tables need, read from the store."""

    run_id: str
    run: dict[str, Any] | None
    steps: dict[str, np.ndarray]                                  # first_screen columns
    sources: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]  # tokens, loss, share
    evals: dict[str, tuple[np.ndarray, np.ndarray, bool]]         # tokens, bpb, reference
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    alerts: list[dict[str, Any]] = field(default_factory=list)


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
    names, rows = _query(client, f"SELECT * FROM {db}.first_screen "
                                 "WHERE run_id = {run:String} ORDER BY step", run_id)
    if not rows:
        known = [r[0] for r in client.query(
            f"SELECT run_id FROM {db}.step_metrics GROUP BY run_id "
            "ORDER BY max(inserted_at) DESC LIMIT 10").result_rows]
        hint = f"; runs in {db}: {', '.join(known)}" if known else f"; {db} holds no run yet"
        raise RunNotFound(f"run {run_id!r} has no steps in {db}.step_metrics{hint}")
    steps = {name: _floats([r[i] for r in rows]) for i, name in enumerate(names)
             if name != "run_id"}
    runs = _dicts(client, f"SELECT * FROM {db}.runs FINAL WHERE run_id = {{run:String}}", run_id)
    sources: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    by_source: dict[str, list[tuple]] = {}
    for row in _query(client, f"SELECT source, tokens, loss, token_share FROM "
                              f"{db}.loss_by_source WHERE run_id = {{run:String}} "
                              "ORDER BY source, step", run_id)[1]:
        by_source.setdefault(row[0], []).append(row[1:])
    for source, values in by_source.items():
        tokens, loss, share = zip(*values)
        sources[source] = (_floats(list(tokens)), _floats(list(loss)), _floats(list(share)))
    evals: dict[str, tuple[np.ndarray, np.ndarray, bool]] = {}
    by_eval: dict[tuple[str, str, int], list[tuple]] = {}
    for suite, stream, reference, tokens, value in _query(
            client, f"SELECT suite, weights_stream, reference, tokens, value FROM "
                    f"{db}.evaluations FINAL WHERE run_id = {{run:String}} AND metric = 'bpb' "
                    "ORDER BY suite, weights_stream, step", run_id)[1]:
        by_eval.setdefault((suite, stream, reference), []).append((tokens, value))
    for (suite, stream, reference), values in by_eval.items():
        tokens, value = zip(*values)
        evals[f"{suite} ({stream})"] = (_floats(list(tokens)), _floats(list(value)),
                                        bool(reference))
    anomalies = _dicts(client, f"""
        SELECT a.step AS step, s.tokens AS tokens, a.signal AS signal, a.kind AS kind,
               a.value AS value, a.baseline AS baseline, a.z AS z, a.culprit AS culprit
        FROM (SELECT * FROM {db}.anomalies FINAL WHERE run_id = {{run:String}}) AS a
        LEFT JOIN (SELECT step, tokens FROM {db}.step_metrics FINAL
                   WHERE run_id = {{run:String}}) AS s ON a.step = s.step
        ORDER BY a.step, a.signal, a.kind""", run_id)
    alerts = _dicts(client, f"SELECT step, tokens, signal, severity, value, baseline, z, "
                            f"culprit, ranks, message, next_steps, fired_at FROM {db}.alerts FINAL "
                            "WHERE run_id = {run:String} ORDER BY step, signal", run_id)
    return FirstScreenData(run_id, runs[0] if runs else None, steps, sources, evals,
                           anomalies, alerts)


def _panel_of(anomaly: dict[str, Any]) -> str | None:
    """The panel an anomaly is marked on (a co-spike on its own panel); None: no panel."""
    if anomaly["kind"] == "cospike":
        return "cospike"
    return next((p.key for p in PANELS if anomaly["signal"] in p.signals), None)


def _anomaly_y(anomaly: dict[str, Any], panel: Panel, data: FirstScreenData) -> float:
    """Where to put the marker: on the panel's first curve at that step, else the value."""
    if panel.columns:
        column = panel.columns[0][0]
        steps = data.steps["step"]
        hit = np.flatnonzero(steps == anomaly["step"])
        if hit.size and np.isfinite(data.steps[column][hit[0]]):
            return float(data.steps[column][hit[0]]) / panel.scale
    return float(anomaly["value"]) / panel.scale


def _draw(ax: Any, x: np.ndarray, y: np.ndarray, label: str, **style: Any) -> bool:
    keep = np.isfinite(x) & np.isfinite(y)
    if not keep.any():
        return False
    ax.plot(x[keep], y[keep], label=label, linewidth=1.0, **style)
    return True


def render_first_screen(data: FirstScreenData) -> Figure:
    """The nine panels on one figure (Agg, no pyplot state). Panel axes are labelled
    ``panel:<key>``; anomaly markers carry gid ``anomaly``, alert lines gid ``alert``."""
    fig = Figure(figsize=(16, 11), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(3, 3).ravel()
    tokens = data.steps["tokens"]
    tick = EngFormatter(sep="")
    pages = sorted({(a["step"], a["tokens"]) for a in data.alerts if a["severity"] == "page"})
    for ax, panel in zip(axes, PANELS):
        ax.set_label(f"panel:{panel.key}")
        ax.set_title(panel.title, fontsize=11)
        ax.set_xlabel("tokens")
        ax.set_ylabel(panel.ylabel)
        ax.xaxis.set_major_formatter(tick)
        ax.grid(True, alpha=0.3)
        drawn = False
        for column, label in panel.columns:
            drawn |= _draw(ax, tokens, data.steps[column] / panel.scale, label,
                           drawstyle="steps-post" if column == "cospike_count" else "default")
        if panel.key == "source":
            for source, (x, loss, share) in sorted(data.sources.items()):
                last = share[np.isfinite(share)]
                share_text = f" ({100 * last[-1]:.0f}% of tokens)" if last.size else ""
                drawn |= _draw(ax, x, loss, f"{source}{share_text}")
        if panel.key == "eval":
            for name, (x, bpb, reference) in sorted(data.evals.items()):
                drawn |= _draw(ax, x, bpb, name + (" [reference]" if reference else ""),
                               marker="o", markersize=3, linestyle="-" if reference else "--")
        right = [(c, label) for c, label in panel.right if np.isfinite(data.steps[c]).any()]
        if right:
            twin = ax.twinx()
            twin.set_ylabel(panel.right_label)
            for column, label in right:
                drawn |= _draw(twin, tokens, data.steps[column], label, color="tab:gray",
                               alpha=0.7)
            twin.legend(loc="upper right", fontsize=8)
        if not drawn:
            ax.set_xticks([])
            ax.set_yticks([])
            ax.text(0.5, 0.5, "not measured", transform=ax.transAxes, ha="center",
                    va="center", color="gray", gid="not-measured")
            continue
        if panel.log and all(np.nanmin(data.steps[c]) > 0 for c, _ in panel.columns
                             if np.isfinite(data.steps[c]).any()):
            ax.set_yscale("log")
        marks = [a for a in data.anomalies if _panel_of(a) == panel.key
                 and a["tokens"] is not None]
        if marks:
            ax.plot([a["tokens"] for a in marks], [_anomaly_y(a, panel, data) for a in marks],
                    linestyle="none", marker="v", markersize=9, color="red",
                    markeredgecolor="black", label="anomaly", gid="anomaly", zorder=5)
        for _step, x in pages:
            if x is not None:
                ax.axvline(x, color="red", linestyle="--", linewidth=0.8, alpha=0.6, gid="alert")
        ax.legend(loc="upper left", fontsize=8)
    run = data.run or {}
    status = f", {run['status']}" if run.get("status") else ""
    fig.suptitle(f"probewire first screen: run {data.run_id}{status} "
                 f"(raw values vs cumulative tokens; red = anomaly, dashed = page)", fontsize=13)
    return fig


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "<br>".join(html.escape(str(v)) for v in value)
    return html.escape(str(value))


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...], empty: str) -> str:
    if not rows:
        return f"<p class='none'>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _html(data: FirstScreenData, png: bytes) -> str:
    steps, tokens = data.steps["step"], data.steps["tokens"]
    run = data.run or {}
    facts = [f"steps {int(steps[0])}–{int(steps[-1])} ({steps.size} stored)",
             f"{int(tokens[-1]):,} tokens"]
    if run:
        facts = [f"status {run['status']}", f"world size {run['world_size']}"] + facts
    title = f"probewire first screen: {data.run_id}"
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
img {{ max-width: 100%; border: 1px solid #ddd; }}
table {{ border-collapse: collapse; font-size: 0.9em; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }} .none {{ color: #777; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(" · ".join(facts))} · generated {generated}</p>
<img alt="first screen of run {html.escape(data.run_id)}"
     src="data:image/png;base64,{base64.b64encode(png).decode()}">
<h2>Alerts ({len(data.alerts)})</h2>
{_table(data.alerts, ("step", "tokens", "severity", "signal", "culprit", "value", "baseline",
                      "z", "ranks", "message", "next_steps"), "No alert fired.")}
<h2>Anomalies ({len(data.anomalies)})</h2>
{_table(data.anomalies, ("step", "tokens", "signal", "kind", "culprit", "value", "baseline",
                         "z"), "No anomaly detected.")}
</body></html>
"""


def write_report(client: Any, database: str, run_id: str,
                 out_dir: str | Path) -> tuple[Path, Path]:
    """Write ``<run_id>.html`` (self-contained) and ``<run_id>.png`` into ``out_dir``."""
    data = load_first_screen(client, database, run_id)
    png = _png(render_first_screen(data))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", run_id)
    png_path, html_path = out / f"{stem}.png", out / f"{stem}.html"
    png_path.write_bytes(png)
    html_path.write_text(_html(data, png), encoding="utf-8")
    return html_path, png_path
