"""Progress of a long command (``probewire demo``, ``probewire run``) while it trains.

On a terminal: one rich status line, redrawn in place (a bar when the total is known).
Anywhere else (a file, a pipe, a CI log): a plain line every ``every_s`` seconds when
something changed, and the last state when it ends, so a log shows the steps stored as
they grow instead of nothing for the whole training phase.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = ["StepProgress"]


class StepProgress:
    """``update(stored, detail)`` as the worker stores steps; a context manager."""

    def __init__(
        self,
        label: str,
        total: int | None = None,
        *,
        out: IO[str] | None = None,
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        enabled: bool = True,
    ) -> None:
        self.label, self.total, self.every_s, self.clock = label, total, every_s, clock
        self.enabled = enabled  # False: silent (a caller that shows nothing)
        self.out = out if out is not None else sys.stderr
        self._started = self._printed_at = clock()
        self._state: tuple[int, str] = (-1, "")
        self._printed: tuple[int, str] | None = None
        self._live: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> StepProgress:
        if self.enabled and self.out.isatty():
            columns: list[Any] = [TextColumn("[bold]{task.description}")]
            if self.total is not None:
                columns += [BarColumn(), MofNCompleteColumn()]
            columns += [TimeElapsedColumn(), TextColumn("{task.fields[detail]}")]
            self._live = Progress(*columns, console=Console(file=self.out), transient=True)
            self._live.start()
            self._task = self._live.add_task(self.label, total=self.total, detail="")
        return self

    def line(self) -> str:
        """The plain line of the current state."""
        stored, detail = self._state
        of = f"/{self.total}" if self.total is not None else ""
        elapsed = self.clock() - self._started
        text = f"probewire: {self.label}: {max(stored, 0)}{of} steps stored, {elapsed:.0f} s"
        return text + (f" · {detail}" if detail else "")

    def update(self, stored: int, detail: str = "") -> None:
        self._state = (stored, detail)
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._task, completed=stored, detail=detail)
            return
        now = self.clock()
        if now - self._printed_at >= self.every_s and self._state != self._printed:
            self._print(now)

    def _print(self, now: float) -> None:
        print(self.line(), file=self.out, flush=True)
        self._printed, self._printed_at = self._state, now

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()
        elif self.enabled and self._state[0] >= 0 and self._state != self._printed:
            self._print(self.clock())  # where it ended
