"""The UI's HTML, rendered on the server from Python data (pure: no I/O).

Every page is whole without scripts: the runs table, the anomalies and the step detail are
tables in the HTML; the charts of the run and compare pages are drawn by ``/static/ui.js``
(plotly.js) from the JSON endpoints, their frames and notes are here.
"""

from __future__ import annotations

import html
import json
import math
import re
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlencode

from probewire.stream.series import CHARTS

from .queries import AXES

__all__ = [
    "RUN_COLUMNS",
    "anomalies_page",
    "chart_specs",
    "charts_page",
    "filter_runs",
    "runs_page",
    "sort_runs",
    "step_page",
    "tag_list",
]

_STYLE = """
body{font:14px system-ui,sans-serif;margin:0 1.2em;color:#222}
header{display:flex;gap:1.2em;align-items:baseline;border-bottom:1px solid #ddd;padding:.5em 0}
header a{color:#1f5fa0;text-decoration:none} h1{font-size:1.2em;margin:.2em 0}
table{border-collapse:collapse;margin:.6em 0} td,th{padding:.2em .6em;border-bottom:1px solid #eee;
text-align:right;white-space:nowrap} th{background:#f6f6f6} td.l,th.l{text-align:left}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:.6em}
.panel{border:1px solid #e4e4e4;border-radius:4px;padding:.2em} .panel .bar{font-size:12px}
.panel .plot{height:290px} .folded{color:#777;font-size:13px} .muted{color:#777}
.tag{background:#eef;border-radius:3px;padding:0 .3em;margin-right:.2em;font-size:12px}
"""


def _page(title: str, body: str, scripts: Sequence[str] = ()) -> str:
    tags = "".join(f'<script src="{html.escape(s)}"></script>' for s in scripts)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)} · probewire</title><style>{_STYLE}</style></head><body>"
        "<header><b>probewire</b><a href='/'>runs</a></header>"
        f"{body}{tags}</body></html>"
    )


def _script_json(text: str) -> str:
    """JSON inside a ``<script>`` element: no ``</`` can end the element early."""
    return text.replace("</", "<\\/")


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.6g}"
    return str(value)


RUN_COLUMNS = (
    ("run_id", "run"),
    ("status", "status"),
    ("world_size", "ranks"),
    ("steps", "steps"),
    ("last_step", "last step"),
    ("tokens", "tokens"),
    ("loss", "last loss"),
    ("pages", "pages"),
    ("anomalies", "anomalies"),
    ("tags", "tags"),
    ("note", "note"),
    ("updated_at", "updated"),
)


def tag_list(text: object) -> list[str]:
    """The tags of the note form's field: words separated by spaces or commas."""
    return [t for t in re.split(r"[\s,]+", str(text or "")) if t]


def filter_runs(rows: list[dict[str, Any]], q: str) -> list[dict[str, Any]]:
    """The runs whose id, status or a tag contains every word of ``q`` (case-insensitive);
    ``tag:x`` matches the tag ``x`` exactly."""
    words = q.lower().split()

    def keep(row: dict[str, Any]) -> bool:
        tags = [t.lower() for t in row.get("tags", [])]
        text = " ".join([row["run_id"].lower(), str(row.get("status", "")).lower(), *tags])
        return all((w[4:] in tags) if w.startswith("tag:") else (w in text) for w in words)

    return [r for r in rows if keep(r)]


def sort_runs(rows: list[dict[str, Any]], key: str, desc: bool) -> list[dict[str, Any]]:
    """Sorted by a column of ``RUN_COLUMNS`` (missing values last either way)."""
    if key not in dict(RUN_COLUMNS):
        return rows
    present = [r for r in rows if r.get(key) is not None]
    missing = [r for r in rows if r.get(key) is None]
    return sorted(present, key=lambda r: r[key], reverse=desc) + missing


def _note_cell(row: dict[str, Any], i: int, read_only: str) -> str:
    """The note and the user's tags: a form of the row's own (outside the compare form,
    its fields tied to it by ``form=``) when notes can be sent, else the note as text."""
    note = html.escape(str(row.get("note") or ""))
    if read_only:
        return f"<td class='l note'>{note}</td>"
    tags = html.escape(" ".join(row.get("user_tags", ())))
    f = f"note-{i}"
    return (
        f"<td class='l note'><input name='note' form='{f}' value='{note}' size='28' "
        f"placeholder='note'> <input name='tags' form='{f}' value='{tags}' size='14' "
        f"placeholder='tags'> <button form='{f}'>save</button></td>"
    )


def runs_page(
    rows: list[dict[str, Any]],
    q: str,
    sort: str,
    desc: bool,
    total: int,
    read_only: str = "",
    noted: str = "",
) -> str:
    """``GET /``: the runs table, filtered and sorted on the server; ``read_only``: why
    notes cannot be set (empty: each row has a note form); ``noted``: the run whose note
    was just sent."""
    head = "".join(
        f"<th class='{'l' if key in ('run_id', 'status', 'tags', 'note') else ''}'>"
        f"<a href='/?{urlencode({'q': q, 'sort': key, 'desc': int(key != sort or not desc)})}'>"
        f"{html.escape(label)}{(' ▼' if desc else ' ▲') if key == sort else ''}</a></th>"
        for key, label in RUN_COLUMNS
    )
    body, forms = [], []
    for i, row in enumerate(rows):
        rid = html.escape(row["run_id"])
        cells = [
            f"<td><input type='checkbox' name='run' value='{rid}'></td>",
            f"<td class='l'><a class='run' href='/run/{rid}'>{rid}</a></td>",
            f"<td class='l'>{html.escape(str(row['status']))}</td>",
        ]
        for key, _ in RUN_COLUMNS[2:-3]:
            value = row.get(key)
            if key == "pages" and value:
                cells.append(f"<td><a href='/run/{rid}/anomalies'>{value}</a></td>")
            else:
                cells.append(f"<td>{_fmt(value)}</td>")
        tags = "".join(f"<span class='tag'>{html.escape(t)}</span>" for t in row["tags"])
        cells.append(f"<td class='l'>{tags}</td>{_note_cell(row, i, read_only)}")
        cells.append(f"<td>{_fmt(row.get('updated_at'))}</td>")
        body.append(f"<tr data-run='{rid}'>{''.join(cells)}</tr>")
        if not read_only:
            action = html.escape(f"/run/{quote(row['run_id'], safe='')}/note")
            forms.append(f"<form id='note-{i}' method='post' action='{action}'></form>")
    form = (
        "<form method='get' action='/'><input name='q' id='q' placeholder='filter: words, "
        f"tag:name' value='{html.escape(q)}' size='40'><input type='hidden' name='sort' "
        f"value='{html.escape(sort)}'><button>filter</button></form>"
    )
    notes = (
        f"<p class='muted' id='notes-read-only'>{html.escape(read_only)}</p>"
        if read_only
        else "<p class='muted'>a note and tags (spaces or commas between them) are sent to "
        "the stream worker, which stores them in <code>runs.note</code> and "
        "<code>runs.tags</code></p>"
    )
    sent = (
        f"<p id='noted'>the note of {html.escape(noted)} was sent; it shows here once the "
        "worker has stored it (reload in a second)</p>"
        if noted
        else ""
    )
    return _page(
        "runs",
        f"<h1>Runs</h1>{sent}{form}<p class='muted'>{len(rows)} of {total} runs · tick runs, "
        "then compare · tags: the <code>tags</code> list of "
        "<code>attach(run_config=...)</code> and those set here</p>"
        "<form method='get' action='/compare'><table id='runs'><thead><tr><th></th>"
        f"{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        f"<button id='compare'>compare the ticked runs</button></form>{notes}{''.join(forms)}",
    )


def chart_specs() -> list[dict[str, Any]]:
    """What the script needs of each chart (the registry's title, unit, axis, smoothing,
    signals)."""
    return [
        {
            "key": c.key,
            "title": c.title,
            "unit": c.unit,
            "log": c.log,
            "count": c.axis.value == "count",
            "smooth": c.smooth,
            "signals": sorted(c.signals),
        }
        for c in CHARTS
    ]


def charts_page(title: str, heading: str, run_ids: list[str], x: str, live: bool) -> str:
    """The run page (one run, live) and the compare page (N runs overlaid)."""
    boot = json.dumps({"runs": run_ids, "x": x, "live": live, "charts": chart_specs()})
    runs_q = urlencode([("run", r) for r in run_ids])
    axes = "".join(
        f"<option value='{k}'{' selected' if k == x else ''}>{html.escape(v)}</option>"
        for k, v in AXES.items()
    )
    links = " · ".join(
        f"<a href='/run/{html.escape(r)}'>{html.escape(r)}</a> "
        f"(<a href='/run/{html.escape(r)}/anomalies'>pages and anomalies</a>)"
        for r in run_ids
    )
    panels = "".join(
        f"<section class='panel' id='panel-{c.key}' data-chart='{c.key}'>"
        f"<div class='bar'><b>{html.escape(c.title)}</b> <span class='muted'>"
        f"[{html.escape(c.unit)}]</span></div><div class='plot'></div></section>"
        for c in CHARTS
    )
    return _page(
        title,
        f"<h1>{html.escape(heading)}</h1><p>{links}</p>"
        f"<p>x axis <select id='xaxis'>{axes}</select> · last step "
        f"<b id='last-step'>-</b> · <span id='state' class='muted'>"
        "charts need scripts</span> · drag a panel to zoom all, double-click to reset</p>"
        f"<div class='grid' id='panels'>{panels}</div>"
        "<h2>Panels without data</h2><ul id='folded' class='folded'></ul>"
        f"<script id='boot' type='application/json'>{_script_json(boot)}</script>"
        # the data is on its way while plotly.js (4.6 MB) is parsed
        f"<script>window.pwFirst = [{_script_json(json.dumps('/api/charts?' + runs_q + '&x=' + x))},"
        f" {_script_json(json.dumps('/api/marks?' + runs_q))}].map(u => fetch(u).then(r => "
        "r.ok ? r.json() : Promise.reject(new Error(u + ': ' + r.status))));</script>",
        ["/static/plotly.min.js", "/static/ui.js"],
    )


def _table(rows: list[dict[str, Any]], columns: Sequence[str], link_step: str = "") -> str:
    if not rows:
        return "<p class='muted'>none</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for c in columns:
            value = row.get(c)
            text = html.escape(_fmt(value) if not isinstance(value, list) else ", ".join(value))
            if c == "step" and link_step:
                text = f"<a href='{link_step}/{value}'>{text}</a>"
            cells.append(f"<td class='l'>{text}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def anomalies_page(run_id: str, pages: list[dict], anomalies: list[dict]) -> str:
    """The run's pages and anomalies, each step a link to its detail page."""
    rid = html.escape(run_id)
    base = f"/run/{rid}/step"
    return _page(
        f"{run_id} pages",
        f"<h1>Pages and anomalies of <a href='/run/{rid}'>{rid}</a></h1>"
        f"<h2>Pages and warnings ({len(pages)})</h2>"
        + _table(pages, ("step", "signal", "severity", "culprit", "message"), base)
        + f"<h2>Anomalies ({len(anomalies)})</h2>"
        + _table(anomalies, ("step", "signal", "kind", "value", "z", "culprit"), base),
    )


def step_page(run_id: str, step: int, explanation: Any, detail: dict[str, list[dict]]) -> str:
    """A step: explain's findings, the retained per-rank and per-tensor rows, the depth
    profiles (a chart when scripts run, the table always)."""
    rid = html.escape(run_id)
    if explanation is None:
        found = "<p class='muted'>explain: the step is not in the store</p>"
    else:
        rows = [
            {
                "stage": f.stage,
                "signal": f.signal,
                "value": f.value,
                "baseline": f.baseline,
                "z": f.z,
                "culprit": f.culprit,
                "moved": "moved" if f.moved else "",
                "note": f.note,
            }
            for f in explanation.findings
        ]
        found = f"<p><b>{html.escape(explanation.headline())}</b></p>" + _table(
            rows, ("stage", "signal", "value", "baseline", "z", "culprit", "moved", "note")
        )
    retained = bool(detail["ranks"] or detail["tensors"])
    depth = json.dumps({"depth": detail["depth"], "residual": detail["residual"]}, default=str)
    return _page(
        f"{run_id} step {step}",
        f"<h1><a href='/run/{rid}'>{rid}</a> · step {step}</h1>"
        f"<p><a href='/run/{rid}/step/{max(step - 1, 0)}'>previous</a> · "
        f"<a href='/run/{rid}/step/{step + 1}'>next</a> · "
        f"<a href='/run/{rid}/anomalies'>pages and anomalies</a></p>"
        f"<h2>What moved (explain)</h2>{found}"
        + (
            ""
            if retained
            else "<p class='muted'>this step's detail was not retained (only "
            "retained steps keep per-rank and per-tensor rows)</p>"
        )
        + "<h2>Depth profile</h2><p class='muted'>per layer: R_b of each branch "
        "(<code>residual_stats</code>), and per kind the mean RMS and the largest |x| of the "
        "layer's tensors (<code>tensor_view</code>)</p><div id='depth' style='height:300px'></div>"
        + _table(detail["residual"], ("layer", "branch", "ratio", "stream_norm", "branch_norm"))
        + _table(detail["depth"], ("layer", "kind", "rms", "abs_max"))
        + f"<h2>Per rank ({len(detail['ranks'])} rows)</h2>"
        + _table(detail["ranks"], ("metric", "labels", "rank", "value", "late"))
        + f"<h2>Per tensor ({len(detail['tensors'])} rows)</h2>"
        + _table(
            detail["tensors"],
            ("tensor", "kind", "n", "abs_max", "rms", "abs_mean", "zero_frac", "nonfinite"),
        )
        + f"<script id='depth-data' type='application/json'>{_script_json(depth)}"
        "</script>",
        ["/static/plotly.min.js", "/static/depth.js"],
    )
