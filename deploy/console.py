"""The console the commands print their tables on.

On a terminal, rich fits a table to the terminal's width. Anywhere else (a file, a pipe, a
pod's log) rich assumes 80 columns and cuts what does not fit with "…": a value of
``3.801e+08`` printed as ``3.801e+…``. There the console is as wide as the table needs,
and the commands' columns fold what a narrow terminal cannot fit instead of cutting it.
"""

from __future__ import annotations

import os
from typing import IO

from rich.console import Console

__all__ = ["UNBOUNDED", "console"]

UNBOUNDED = 10_000
"""Columns of a console that is not a terminal: a table takes the width it needs."""


def console(file: IO[str] | None = None) -> Console:
    """A console on ``file`` (stdout): a terminal's own width (or ``COLUMNS``), else
    ``UNBOUNDED``."""
    out = Console(file=file)
    if not (out.is_terminal or "COLUMNS" in os.environ):
        out.width = UNBOUNDED
    return out
