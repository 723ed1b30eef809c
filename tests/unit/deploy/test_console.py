"""The commands' console: a table printed into a file or a pipe keeps every cell whole."""

from __future__ import annotations

import io

from rich.table import Table

from probewire.deploy.console import UNBOUNDED, console

ROW = ("memory", "peak_memory_bytes_of_the_slowest_rank", "3.801e+08", "3.795e+08", "rank 12")


def _printed(out, stream: io.StringIO) -> str:
    table = Table(title="a wide table")
    for column in ("stage", "signal", "value", "baseline", "culprit"):
        table.add_column(column)
    table.add_row(*ROW)
    table.add_row(*(cell * 3 for cell in ROW))  # wider than 80 columns
    out.print(table)
    return stream.getvalue()


def test_output_that_is_not_a_terminal_keeps_every_cell_whole(monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    stream = io.StringIO()
    out = console(stream)
    assert out.width == UNBOUNDED
    text = _printed(out, stream)
    assert "…" not in text
    for cell in ROW:
        assert cell * 3 in text  # whole, on one line


def test_columns_in_the_environment_are_the_width(monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "50")
    assert console(io.StringIO()).width == 50
