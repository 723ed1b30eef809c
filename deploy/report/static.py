"""The first screen of one run as a PNG, for chat and tickets.

Nine panels, one per P0 signal of the first screen (seeds 001 §1), drawn from the
``first_screen`` and ``loss_by_source`` views and the ``evaluations`` table: raw values,
never smoothed, against cumulative tokens (runs are compared by tokens, not steps).
Anomalies from the ``anomalies`` table are red triangles on the panel of their signal;
pages from the ``alerts`` table are dashed red lines across every panel. A panel with
nothing measured in the run (no evaluation, no expert layer) is folded away: the panels
with data fill the grid and a note under it names the others (no empty tile).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

from probewire.deploy.report.load import FirstScreenData, source_shares
from probewire.stream.series import CHARTS, Axis, Chart, chart_columns

__all__ = ["PANELS", "Panel", "png", "render_first_screen"]


@dataclass(frozen=True, slots=True)
class Panel:
    """One of the nine panels, made from the registry's charts (``stream.series.CHARTS``):
    the chart whose panel it is, the columns of the charts drawn on its right axis, and the
    signals of every chart marked on it. ``scale`` divides values for display."""

    key: str
    title: str
    ylabel: str
    columns: tuple[tuple[str, str], ...] = ()  # (column, legend label)
    right: tuple[tuple[str, str], ...] = ()
    right_label: str = ""
    signals: frozenset[str] = frozenset()
    log: bool = False
    scale: float = 1.0
    count: bool = False  # a cumulative count: from 0, integer ticks, drawn as steps


def _panel(chart: Chart) -> Panel:
    others = [c for c in CHARTS if c.panel == chart.key and c is not chart]
    right = [c for c in others if c.right]
    return Panel(
        chart.key,
        chart.panel_title,
        chart.unit,
        chart_columns(chart),
        tuple(column for c in right for column in chart_columns(c)),
        " / ".join(c.unit for c in right),
        chart.signals.union(*(c.signals for c in others)),
        chart.log,
        chart.scale,
        chart.axis is Axis.COUNT,
    )


PANELS: tuple[Panel, ...] = tuple(_panel(c) for c in CHARTS if c.panel == c.key)


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


def _tokens_at(data: FirstScreenData, steps: np.ndarray) -> np.ndarray:
    """Cumulative tokens of the run at ``steps`` (NaN where the step is not stored)."""
    lookup = dict(zip(data.steps["step"].tolist(), data.steps["tokens"].tolist()))
    return np.array([lookup.get(s, np.nan) for s in steps.tolist()], dtype=np.float64)


def _draw(ax: Any, x: np.ndarray, y: np.ndarray, label: str, **style: Any) -> None:
    keep = np.isfinite(x) & np.isfinite(y)
    if keep.any():
        ax.plot(x[keep], y[keep], label=label, linewidth=1.0, **style)


def render_first_screen(data: FirstScreenData) -> Figure:
    """The nine panels on one figure (Agg, no pyplot state). Panel axes are labelled
    ``panel:<key>``; anomaly markers carry gid ``anomaly``, alert lines gid ``alert``.
    Every text is plain text: a `$` in a run id or a source name is not mathtext."""
    with matplotlib.rc_context({"text.parse_math": False}):
        return _render(data)


def _measured(panel: Panel, data: FirstScreenData) -> bool:
    """Whether the run measured anything the panel draws (else it is folded away)."""
    if any(np.isfinite(data.steps[c]).any() for c, _ in (*panel.columns, *panel.right)):
        return True
    if panel.key == "source":
        return any(np.isfinite(loss).any() for _, loss, _ in data.sources.values())
    if panel.key == "eval":
        return any(ev.metric == "bpb" and np.isfinite(ev.value).any() for ev in data.evals)
    return False


def _render(data: FirstScreenData) -> Figure:
    shown = [p for p in PANELS if _measured(p, data)]
    folded = [p.title for p in PANELS if p not in shown]
    rows = max(1, math.ceil(len(shown) / 3))
    fig = Figure(figsize=(16, 11 * rows / 3 + 0.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 3, squeeze=False).ravel()
    pages = sorted({(a["step"], a["tokens"]) for a in data.alerts if a["severity"] == "page"})
    for ax, panel in zip(axes, shown):
        ax.set_label(f"panel:{panel.key}")
        ax.set_title(panel.title, fontsize=11)
        ax.set_xlabel("tokens")
        ax.set_ylabel(panel.ylabel)
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.grid(True, alpha=0.3)
        _draw_panel(ax, panel, data)
        _mark(ax, panel, data, pages)
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    if folded:
        fig.text(
            0.5,
            0.0,
            "Not measured in this run, folded away: " + "; ".join(folded),
            ha="center",
            va="bottom",
            color="gray",
            gid="folded",
        )
    run = data.run or {}
    status = f", {run['status']}" if run.get("status") else ""
    fig.suptitle(
        f"probewire first screen: run {data.run_id}{status} "
        f"(raw values vs cumulative tokens; red = anomaly, dashed = page)",
        fontsize=13,
    )
    return fig


def _draw_panel(ax: Any, panel: Panel, data: FirstScreenData) -> None:
    """The panel's curves (its columns, sources, evaluations, right axis)."""
    tokens = data.steps["tokens"]
    for column, label in panel.columns:
        style = "steps-post" if panel.count else "default"
        _draw(ax, tokens, data.steps[column] / panel.scale, label, drawstyle=style)
    if panel.key == "source":
        shares = source_shares(data.sources)
        for source, (step, loss, _) in sorted(data.sources.items()):
            share = shares[source]
            share_text = f" ({100 * share:.0f}% of tokens)" if np.isfinite(share) else ""
            _draw(ax, _tokens_at(data, step), loss, f"{source}{share_text}")
    if panel.key == "eval":
        for ev in sorted(data.evals, key=lambda e: e.name):
            if ev.metric == "bpb":
                _draw(
                    ax,
                    ev.tokens,
                    ev.value,
                    f"{ev.suite} ({ev.stream})" + (" [reference]" if ev.reference else ""),
                    marker="o",
                    markersize=3,
                    linestyle="-" if ev.reference else "--",
                )
    right = [(c, label) for c, label in panel.right if np.isfinite(data.steps[c]).any()]
    if right:
        twin = ax.twinx()
        twin.set_ylabel(panel.right_label)
        for column, label in right:
            _draw(twin, tokens, data.steps[column], label, color="tab:gray", alpha=0.7)
        twin.legend(loc="upper right", fontsize=8)


def _mark(ax: Any, panel: Panel, data: FirstScreenData, pages: list[tuple]) -> None:
    """The panel's axis (a count from 0, log where every value is positive), its anomaly
    markers and the pages' lines."""
    if panel.count:  # a count: from 0, integer ticks, never a ±0.04 axis
        top = np.nanmax(data.steps[panel.columns[0][0]])
        ax.set_ylim(0, max(1.0, float(top)) * 1.1)
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if panel.log and all(
        np.nanmin(data.steps[c]) > 0 for c, _ in panel.columns if np.isfinite(data.steps[c]).any()
    ):
        ax.set_yscale("log")
    marks = [a for a in data.anomalies if _panel_of(a) == panel.key and a["tokens"] is not None]
    if marks:
        ax.plot(
            [a["tokens"] for a in marks],
            [_anomaly_y(a, panel, data) for a in marks],
            linestyle="none",
            marker="v",
            markersize=9,
            color="red",
            markeredgecolor="black",
            label="anomaly",
            gid="anomaly",
            zorder=5,
        )
    for _step, x in pages:
        if x is not None:
            ax.axvline(x, color="red", linestyle="--", linewidth=0.8, alpha=0.6, gid="alert")
    ax.legend(loc="upper left", fontsize=8)


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
