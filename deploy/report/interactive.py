"""The interactive report: one self-contained HTML page comparing one or more runs.

Every panel is a plotly chart (plotly.js inlined: the page works offline). The runs are
overlaid on one x axis, switchable between cumulative tokens, cumulative FLOPs and step;
hovering a point shows its value with its unit. Optional smoothing (an exponential moving
average, off by default) adds a smoothed line per series and leaves the raw series drawn.
Anomalies are triangles on the panel of their signal, pages dashed lines across every
panel. A user metric (``Monitor.log``, ``user_metrics``) is a chart of its own after the
registry's charts; a chart with nothing stored in the runs is folded away into one note
under the charts (no empty tile). Below the charts: the runs' configurations side by side and their alerts and
anomalies as tables.

The page is built from Python data only; the small script at the end re-draws x values
and smoothed lines from each trace's ``meta`` (no server, no network).
"""

from __future__ import annotations

import html
import json
import math
from datetime import UTC, datetime
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs

from probewire.deploy.report.load import FirstScreenData, source_shares
from probewire.stream.messages import describe_value, what_moved
from probewire.stream.series import CHARTS, Axis, Chart, chart_columns

__all__ = ["AXES", "CHARTS", "Chart", "build_figures", "render_html"]

AXES = {"tokens": "cumulative tokens", "flops": "cumulative FLOPs", "step": "step"}
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
_DASHES = ("solid", "dot", "dash", "longdash", "dashdot")


_COLUMNS = {c.key: chart_columns(c) for c in CHARTS}


def _list(values: np.ndarray) -> list[float | None]:
    """JSON-safe values: NaN and infinities become gaps (None), never zero."""
    return [float(v) if np.isfinite(v) else None for v in np.asarray(values, dtype=np.float64)]


def _at(data: FirstScreenData, steps: np.ndarray) -> dict[str, list[float | None]]:
    """The three x coordinates of ``steps`` of the run (None where a step is not stored)."""
    index = {s: i for i, s in enumerate(data.steps["step"].tolist())}
    rows = [index.get(s) for s in np.asarray(steps, dtype=np.float64).tolist()]
    return {
        axis: [
            None
            if i is None or not np.isfinite(data.steps[axis][i])
            else float(data.steps[axis][i])
            for i in rows
        ]
        for axis in AXES
    }


def _series(
    fig: go.Figure,
    run: int,
    data: FirstScreenData,
    label: str,
    unit: str,
    x: dict[str, list[float | None]],
    y: np.ndarray,
    dash: int = 0,
    markers: bool = False,
    smooth: bool = True,
) -> None:
    """A raw trace (x switchable through ``meta``) and, where its chart may be smoothed
    (``Chart.smooth``: never a count or a setting such as the learning rate), its smoothed
    twin (hidden until smoothing is on; it never replaces the raw trace)."""
    if not np.isfinite(np.asarray(y, dtype=np.float64)).any():
        return
    name = f"{data.run_id} · {label}"
    color = _COLORS[run % len(_COLORS)]
    meta = {"x": x, "role": "raw", "run": data.run_id, "label": label, "unit": unit}
    fig.add_trace(
        go.Scatter(
            x=x["tokens"],
            y=_list(y),
            name=name,
            legendgroup=data.run_id,
            mode="lines+markers" if markers else "lines",
            line={"color": color, "width": 1.2, "dash": _DASHES[dash % len(_DASHES)]},
            marker={"size": 5},
            meta=meta,
            hovertemplate=f"<b>{html.escape(name)}</b><br>%{{x:.4s}}<br>%{{y:.5g}} "
            f"{html.escape(unit)}<extra></extra>",
        )
    )
    if not smooth:
        return
    fig.add_trace(
        go.Scatter(
            x=x["tokens"],
            y=_list(y),
            name=f"{name} (smoothed)",
            legendgroup=data.run_id,
            mode="lines",
            visible=False,
            showlegend=False,
            line={"color": color, "width": 2.4, "dash": _DASHES[dash % len(_DASHES)]},
            meta={**meta, "role": "smooth"},
            hovertemplate=f"<b>{html.escape(name)} (smoothed)</b><br>%{{x:.4s}}<br>%{{y:.5g}} "
            f"{html.escape(unit)}<extra></extra>",
        )
    )


def _panel_of(anomaly: dict[str, Any]) -> str | None:
    """The chart an anomaly is marked on (a co-spike on its own chart); None: none."""
    if anomaly["kind"] == "cospike":
        return "cospike"
    return next((c.key for c in CHARTS if anomaly["signal"] in c.signals), None)


def _anomalies(fig: go.Figure, chart: Chart, data: FirstScreenData) -> None:
    marks = [a for a in data.anomalies if _panel_of(a) == chart.key and a["tokens"] is not None]
    if not marks:
        return
    y = []
    for a in marks:  # on the chart's first curve at that step, else the anomaly's value
        hit = np.flatnonzero(data.steps["step"] == a["step"])
        column = _COLUMNS[chart.key][0][0] if _COLUMNS[chart.key] else None
        value = data.steps[column][hit[0]] if column and hit.size else np.nan
        y.append(float(value) / chart.scale if np.isfinite(value) else float(a["value"]))
    text = [
        f"{what_moved(a['signal'], a['kind'])} at step {a['step']}: "
        f"{describe_value(a['signal'], a['kind'], a['value'])}"
        + (f" ({a['culprit']})" if a["culprit"] else "")
        for a in marks
    ]
    x = {
        "tokens": [float(a["tokens"]) for a in marks],
        "flops": [None if a["flops"] is None else float(a["flops"]) for a in marks],
        "step": [float(a["step"]) for a in marks],
    }
    fig.add_trace(
        go.Scatter(
            x=x["tokens"],
            y=y,
            mode="markers",
            name=f"{data.run_id} · anomaly",
            legendgroup=data.run_id,
            showlegend=False,
            text=text,
            marker={
                "symbol": "triangle-down",
                "size": 11,
                "color": "red",
                "line": {"color": "black", "width": 1},
            },
            meta={"x": x, "role": "anomaly", "run": data.run_id},
            hovertemplate="%{text}<extra></extra>",
        )
    )


def _pages(runs: list[FirstScreenData]) -> list[dict[str, Any]]:
    return [
        {
            "run": d.run_id,
            "step": float(a["step"]),
            "tokens": float(a["tokens"]),
            "flops": None if a["flops"] is None else float(a["flops"]),
            "text": a["message"],
        }
        for d in runs
        for a in d.alerts
        if a["severity"] == "page"
    ]


def _chart(chart: Chart, runs: list[FirstScreenData]) -> go.Figure:
    fig = go.Figure()
    for i, data in enumerate(runs):
        x = {axis: _list(data.steps[axis]) for axis in AXES}
        for dash, (column, label) in enumerate(_COLUMNS[chart.key]):
            y = data.steps[column] / chart.scale
            _series(fig, i, data, label, chart.unit, x, y, dash, smooth=chart.smooth)
        if chart.key == "source":
            shares = source_shares(data.sources)
            for dash, (source, (step, loss, _)) in enumerate(sorted(data.sources.items())):
                share = shares[source]
                label = source + (f" ({100 * share:.0f}% of tokens)" if np.isfinite(share) else "")
                _series(fig, i, data, label, chart.unit, _at(data, step), loss, dash)
        if chart.key == "eval":
            for dash, ev in enumerate(sorted(data.evals, key=lambda e: e.name)):
                unit = "bits/byte" if ev.metric == "bpb" else ev.metric
                x_ev = {
                    "tokens": _list(ev.tokens),
                    "flops": _list(ev.flops),
                    "step": _list(ev.step),
                }
                _series(
                    fig,
                    i,
                    data,
                    ev.name + (" [reference]" if ev.reference else ""),
                    unit,
                    x_ev,
                    ev.value,
                    dash,
                    markers=True,
                )
        _anomalies(fig, chart, data)
    return _laid_out(fig, chart)


def _user_chart(name: str, runs: list[FirstScreenData]) -> go.Figure:
    """One chart per user metric (``Monitor.log``): each run's stored values at their
    steps, with the reduction over ranks the script declared in the title."""
    logged = [(i, d, d.users[name]) for i, d in enumerate(runs) if name in d.users]
    reductions = ", ".join(sorted({reduction for _, _, (reduction, _, _) in logged}))
    chart = Chart(f"user:{name}", f"{name} (your metric; {reductions} over ranks)", "as logged")
    fig = go.Figure()
    for i, data, (_, step, value) in logged:
        _series(fig, i, data, name, chart.unit, _at(data, step), value, markers=step.size <= 200)
    return _laid_out(fig, chart)


def _laid_out(fig: go.Figure, chart: Chart) -> go.Figure:
    """The chart's layout: title, axes, and whether anything was drawn."""
    drawn = any(t.meta["role"] == "raw" for t in fig.data)
    yaxis = _yaxis(
        chart, [np.array(t.y, dtype=np.float64) for t in fig.data if t.meta["role"] == "raw"]
    )
    fig.update_layout(
        title={"text": chart.title, "font": {"size": 14}},
        height=320,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        hovermode="closest",
        xaxis={"title": {"text": AXES["tokens"]}, "exponentformat": "SI"},
        yaxis=yaxis,
        legend={"font": {"size": 10}},
        meta={"chart": chart.key, "drawn": drawn},  # not drawn: folded away (``_grid``)
    )
    return fig


def _yaxis(chart: Chart, raw: list[np.ndarray]) -> dict[str, Any]:
    """The chart's y axis over its raw traces: a count from 0 with integer ticks, a setting
    (the learning rate) from 0 so a constant reads as its value, log where it is asked for
    and every value is positive."""
    yaxis: dict[str, Any] = {"title": {"text": chart.unit}, "zeroline": False}
    top = max((float(np.nanmax(y)) for y in raw), default=math.nan)
    if chart.axis is Axis.COUNT:
        top = max(1.0, top) if raw else 1.0
        yaxis.update(range=[0, top * 1.1], tick0=0, dtick=max(1, int(np.ceil(top / 5))))
    if chart.axis is Axis.SETTING and math.isfinite(top) and top > 0:
        yaxis.update(range=[0, top * 1.25], tickformat=".3~g")
    if chart.log and raw and all(np.nanmin(y) > 0 for y in raw):
        yaxis["type"] = "log"
    return yaxis


def build_figures(runs: list[FirstScreenData]) -> list[go.Figure]:
    """One figure per chart of ``CHARTS``, then one per user metric, every run overlaid."""
    names = sorted({name for data in runs for name in data.users})
    return [_chart(chart, runs) for chart in CHARTS] + [_user_chart(n, runs) for n in names]


def _grid(figures: list[go.Figure]) -> tuple[str, str]:
    """The drawn charts' divs, and the note naming the charts folded away (nothing of
    theirs is stored in these runs): no empty tile."""
    divs = "\n".join(
        f"<div class='pw-chart' id='chart-{html.escape(fig.layout.meta['chart'])}' "
        f"data-chart='{html.escape(fig.layout.meta['chart'])}'><script type='application/json'>"
        + fig.to_json().replace("</", "<\\/")
        + "</script></div>"
        for fig in figures
        if fig.layout.meta["drawn"]
    )
    folded = [fig.layout.title.text for fig in figures if not fig.layout.meta["drawn"]]
    note = (
        "<p id='pw-folded' class='none'>Not measured, folded away: "
        + html.escape("; ".join(folded))
        + "</p>"
        if folded
        else ""
    )
    return divs, note


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "<br>".join(html.escape(str(v)) for v in value)
    if isinstance(value, dict):
        return html.escape(json.dumps(value, sort_keys=True))
    return html.escape(str(value))


def _table(rows: list[dict[str, Any]], columns: tuple[str, ...], empty: str, css: str = "") -> str:
    if not rows:
        return f"<p class='none'>{html.escape(empty)}</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(r.get(c))}</td>" for c in columns) + "</tr>" for r in rows
    )
    return f"<table class='{css}'><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _config_rows(runs: list[FirstScreenData]) -> list[dict[str, Any]]:
    """One row per configuration key, one column per run; ``differs`` marks the keys
    whose values are not the same in every run."""
    configs = [d.config for d in runs]
    keys = sorted({k for c in configs for k in c})
    rows = []
    for key in keys:
        values = [c.get(key) for c in configs]
        rows.append(
            {
                "key": key,
                "differs": "yes"
                if len({json.dumps(v, sort_keys=True) for v in values}) > 1
                else "",
                **{d.run_id: v for d, v in zip(runs, values)},
            }
        )
    return rows


def _with_units(row: dict[str, Any]) -> dict[str, Any]:
    """An anomaly row whose value and baseline carry their unit (a gap: its ratio to L)."""
    return {
        **row,
        **{k: describe_value(row["signal"], row["kind"], row[k]) for k in ("value", "baseline")},
    }


def _facts(data: FirstScreenData) -> str:
    steps, tokens = data.steps["step"], data.steps["tokens"]
    run = data.run or {}
    facts = [
        f"steps {int(steps[0])}–{int(steps[-1])} ({steps.size} stored)",
        f"{int(tokens[-1]):,} tokens",
    ]
    if run:
        facts = [f"status {run['status']}", f"world size {run['world_size']}"] + facts
    return f"<li><b>{html.escape(data.run_id)}</b>: {html.escape(' · '.join(facts))}</li>"


_SCRIPT = """
(function () {
  const charts = Array.from(document.querySelectorAll('.pw-chart'));
  function ema(y, alpha) {  // NaN-aware: a gap stays a gap and does not reset the mean
    let m = null;
    return y.map(v => (v === null || !isFinite(v)) ? null
                                                   : (m = (m === null ? v : alpha * m + (1 - alpha) * v)));
  }
  function pages(div, axis) {
    return PW_PAGES.filter(p => p[axis] !== null).map(p => ({
      type: 'line', xref: 'x', yref: 'paper', x0: p[axis], x1: p[axis], y0: 0, y1: 1,
      line: {color: 'red', width: 1, dash: 'dash'}, opacity: 0.6, name: 'page'}));
  }
  function apply() {
    const axis = document.getElementById('pw-x').value;
    const alpha = parseFloat(document.getElementById('pw-smooth').value);
    document.getElementById('pw-smooth-value').textContent = alpha > 0 ? alpha.toFixed(2) : 'off';
    for (const div of charts) {
      const idx = [], xs = [], ys = [], vis = [], op = [];
      div.data.forEach((t, i) => {
        idx.push(i); xs.push(t.meta.x[axis]);
        if (t.meta.role === 'smooth') {
          const raw = div.data[i - 1];
          ys.push(ema(raw.y, alpha)); vis.push(alpha > 0); op.push(1);
        } else {
          ys.push(t.y); vis.push(true); op.push(t.meta.role === 'raw' && alpha > 0 ? 0.35 : 1);
        }
      });
      Plotly.update(div, {x: xs, y: ys, visible: vis, opacity: op},
                    {'xaxis.title.text': PW_AXES[axis], 'xaxis.autorange': true,
                     shapes: pages(div, axis)}, idx);
    }
    document.body.dataset.xaxis = axis;
  }
  for (const div of charts) {
    const spec = JSON.parse(div.querySelector('script[type="application/json"]').textContent);
    Plotly.newPlot(div, spec.data, spec.layout,
                   {displaylogo: false, responsive: true, showLink: false,
                    toImageButtonOptions: {format: 'png', filename: div.id}});
  }
  document.getElementById('pw-x').addEventListener('change', apply);
  document.getElementById('pw-smooth').addEventListener('input', apply);
  window.probewire = {apply: apply, ema: ema};
  apply();
  document.body.dataset.ready = '1';
})();
"""


_ALERT_COLUMNS = (
    "step",
    "tokens",
    "severity",
    "signal",
    "culprit",
    "value",
    "baseline",
    "z",
    "ranks",
    "message",
    "next_steps",
)
_ANOMALY_COLUMNS = ("step", "tokens", "signal", "kind", "culprit", "value", "baseline", "z")


def _run_tables(runs: list[FirstScreenData]) -> list[str]:
    """Each run's alerts and anomalies as HTML tables, with headings."""
    tables = []
    for data in runs:
        run = html.escape(data.run_id)
        tables.append(f"<h3>{run}: alerts ({len(data.alerts)})</h3>")
        tables.append(_table(data.alerts, _ALERT_COLUMNS, "No alert fired."))
        tables.append(f"<h3>{run}: anomalies ({len(data.anomalies)})</h3>")
        anomalies = [_with_units(a) for a in data.anomalies]
        tables.append(_table(anomalies, _ANOMALY_COLUMNS, "No anomaly detected."))
    return tables


def render_html(runs: list[FirstScreenData], figures: list[go.Figure] | None = None) -> str:
    """The whole page: controls, one div per chart, configs, alerts and anomalies."""
    figures = build_figures(runs) if figures is None else figures
    names = ", ".join(d.run_id for d in runs)
    title = f"probewire report: {names}"
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    divs, folded = _grid(figures)
    options = "".join(f"<option value='{k}'>{html.escape(v)}</option>" for k, v in AXES.items())
    config_rows = _config_rows(runs)
    tables = _run_tables(runs)
    pages = json.dumps(_pages(runs)).replace("</", "<\\/")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }}
#pw-controls {{ position: sticky; top: 0; background: #fff; padding: 0.5em 0; z-index: 10;
               border-bottom: 1px solid #ddd; }}
#pw-grid {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr));
           gap: 0.5em; }}
table {{ border-collapse: collapse; font-size: 0.9em; margin-bottom: 1.5em; }}
th, td {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }} .none {{ color: #777; }}
</style>
<script>{get_plotlyjs()}</script>
</head><body>
<h1>{html.escape(title)}</h1>
<ul>{"".join(_facts(d) for d in runs)}</ul>
<p>generated {generated} · raw values; red triangles = anomalies, dashed red lines = pages</p>
<div id="pw-controls">
<label>x axis <select id="pw-x">{options}</select></label>
<label style="margin-left:2em">smoothing (EMA weight)
<input type="range" id="pw-smooth" min="0" max="0.99" step="0.01" value="0">
<span id="pw-smooth-value">off</span></label>
<span style="margin-left:2em;color:#666">the raw series stay drawn when smoothing is on</span>
</div>
<div id="pw-grid">
{divs}
</div>
{folded}
<h2>Configuration</h2>
{_table(config_rows, ("key", "differs", *(d.run_id for d in runs)), "No run recorded a configuration.", "pw-config")}
<h2>Alerts and anomalies</h2>
{"".join(tables)}
<script>const PW_AXES = {json.dumps(AXES)}; const PW_PAGES = {pages};</script>
<script>{_SCRIPT}</script>
</body></html>
"""
