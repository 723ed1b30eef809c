"""``probewire report``: one or more runs as an interactive HTML page and a PNG per run.

``load`` reads the store, ``interactive`` builds the self-contained HTML page (plotly,
runs overlaid, x axis switchable), ``static`` draws the PNG first screen (matplotlib).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from probewire.deploy.report.interactive import CHARTS, build_figures, render_html
from probewire.deploy.report.load import (
    FirstScreenData,
    RunNotFound,
    load_first_screen,
    load_runs,
    source_shares,
)
from probewire.deploy.report.static import PANELS, png, render_first_screen

__all__ = [
    "CHARTS",
    "PANELS",
    "FirstScreenData",
    "RunNotFound",
    "build_figures",
    "load_first_screen",
    "load_runs",
    "render_first_screen",
    "render_html",
    "source_shares",
    "write_report",
]


def _stem(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", run_id)


def write_report(
    client: Any, database: str, run_ids: str | list[str], out_dir: str | Path
) -> tuple[Path, list[Path]]:
    """Write the HTML page of ``run_ids`` (``<run>.html``, or ``<a>-vs-<b>.html``) and one
    ``<run>.png`` per run into ``out_dir``; returns (html path, png paths)."""
    runs = load_runs(client, database, [run_ids] if isinstance(run_ids, str) else list(run_ids))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    for data in runs:
        path = out / f"{_stem(data.run_id)}.png"
        path.write_bytes(png(render_first_screen(data)))
        pngs.append(path)
    html_path = out / ("-vs-".join(_stem(d.run_id) for d in runs) + ".html")
    html_path.write_text(render_html(runs), encoding="utf-8")
    return html_path, pngs
