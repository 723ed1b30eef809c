"""``probewire explain`` on a terminal: the walk as a table, the notes, the headline."""

from __future__ import annotations

import math
from typing import Any

from .model import Explanation, _fmt

__all__ = ["render"]


def render(explanation: Explanation, console: Any = None) -> None:
    """Print the walk as a rich table (moved rows in bold red, the paging signal's row
    marked), what paged with its record, the notes and the headline; on ``console``, else
    on stdout (``deploy.console``: no cell cut when stdout is not a terminal)."""
    from rich.table import Table

    from probewire.deploy.console import console as default_console

    console = console or default_console()
    table = Table(
        title=f"run {explanation.run_id}, step {explanation.step} "
        f"({explanation.tokens:,} tokens); scanned steps "
        f"{explanation.scanned_from}–{explanation.step}"
    )
    for column in ("stage", "signal", "value", "baseline", "×", "z", "since", "culprit"):
        table.add_column(
            column,
            justify="right" if column in ("value", "baseline", "×", "z", "since") else "left",
            overflow="fold",
        )  # a narrow terminal wraps a cell, never cuts it
    paging = {p.finding for p in explanation.pages}
    for f in explanation.findings:
        z = "" if f.z is None else ("inf" if not math.isfinite(f.z) else f"{f.z:.1f}")
        table.add_row(
            f.stage,
            ("▶ " if f.signal in paging else "") + f.signal,
            _fmt(f.value),
            _fmt(f.baseline),
            "" if f.ratio is None else f"{f.ratio:.3g}",
            z,
            "" if f.onset_step is None else str(f.onset_step),
            f.culprit or "",
            style="bold red" if f.moved else None,
        )
    console.print(table)
    for p in explanation.pages:
        console.print(f"  paged: {p.message}" if p.message else f"  paged: {p.signal}")
    for f in explanation.findings:
        if f.note and (f.moved or f.stage == "job state"):
            console.print(f"  {f.signal}: {f.note}")
    console.print(explanation.headline(), style="bold")
