"""A user's own metrics: ``Monitor.log(name, value, step=...)`` and ``StepContext.log``.

An evaluation accuracy, a data-loader metric, a norm of one's own: one series per name,
sent on the same wire as the probes (one message per rank and step) as a point of the
catalog metric that carries the reduction the user declared (``User``), labelled
``name``. The stream reduces it over ranks by that metric's catalog rule and stores one
row per (run, step, name) in ``user_metrics``:

=========  =====================================================  =====================
reduction  sent as                                                stored value
=========  =====================================================  =====================
mean       ``user.mean`` (the value) and ``user.ranks`` (1)       Σ values / Σ ranks
sum        ``user.sum``                                           Σ values
max        ``user.max``                                           max over ranks
rank0      ``user.first``, by rank 0 only                         rank 0's value
=========  =====================================================  =====================

A name is 1 to ``NAME_MAX`` characters of letters, digits, ``_ . - /``, starting with a
letter (``eval/acc``, ``loader.wait_s``); a bad name, value or reduction is a one-line
error where ``log`` is called. One name keeps one reduction for the run. A rank sends at
most ``MAX_NAMES`` names per run: a new name past that is dropped and counted
(``UserLog.dropped``, ``Monitor.stats["user_dropped"]``, one warning); so is a value past
``4 * MAX_NAMES`` held for steps not yet sent. A NaN or ±inf is
sent as measured and stored (what a diverging evaluation measures), never dropped.

A value goes with the step it is logged for: ``s.log`` inside a step context with that
step, ``Monitor.log(..., step=None)`` with the step now open or else the next one the loop
opens, ``step=N`` with step N (a step that already closed is an error). A step the
monitor does not send (a sparse step-tier cadence) hands its values on to the next step
it sends (the newest value per name). Torch-free.
"""

from __future__ import annotations

import logging
import re

from .catalog import Label, User
from .wire import Point

__all__ = ["MAX_NAMES", "NAME_MAX", "REDUCTIONS", "UserLog", "name_problem"]

log = logging.getLogger(__name__)

NAME_MAX = 100
MAX_NAMES = 256
REDUCTIONS = ("mean", "sum", "max", "rank0")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_./-]*")
_METRIC = {"sum": User.SUM, "max": User.MAX, "rank0": User.FIRST}


def name_problem(name: object) -> str | None:
    """Why ``name`` is not a user metric name, or None when it is one."""
    if isinstance(name, str) and len(name) <= NAME_MAX and _NAME.fullmatch(name):
        return None
    return (
        f"user metric name {name!r} must be 1-{NAME_MAX} characters of letters, digits, "
        "'_', '.', '-' or '/', starting with a letter (e.g. 'eval/acc')"
    )


def _number(name: str, value: object) -> float:
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TypeError(
            f"log({name!r}, value): value must be a number (int, float, a one-element "
            f"tensor), got {type(value).__name__}"
        ) from None


def points(name: str, value: float, reduction: str, rank: int) -> list[Point]:
    """The wire points of one logged value on rank ``rank``."""
    labels = ((Label.NAME, name),)
    if reduction == "mean":
        return [Point(User.MEAN, value, labels), Point(User.RANKS, 1.0, labels)]
    if reduction == "rank0" and rank != 0:
        return []
    return [Point(_METRIC[reduction], value, labels)]


class UserLog:
    """The values a rank's loop logged and not yet sent, by name (see the module doc)."""

    def __init__(self, rank: int, max_names: int = MAX_NAMES) -> None:
        self.rank, self.max_names = rank, max_names
        self.reductions: dict[str, str] = {}  # every name this rank logged, its reduction
        self.dropped = 0  # values of names past max_names
        self.closed = -1  # the newest step whose context closed
        self._pending: dict[tuple[str, int | None], float] = {}

    def log(self, name: str, value: object, reduction: str = "mean", step: int | None = None):
        """Hold ``value`` for ``step`` (None: the next step sent); checks the call first."""
        problem = name_problem(name)
        if problem is not None:
            raise ValueError(problem)
        number = _number(name, value)
        if reduction not in REDUCTIONS:
            raise ValueError(
                f"log({name!r}): reduction must be one of {', '.join(REDUCTIONS)}, "
                f"got {reduction!r}"
            )
        if step is not None and step <= self.closed:
            raise ValueError(
                f"log({name!r}, step={step}): step {step} has closed (the newest closed step "
                f"is {self.closed}); log inside the step (s.log) or for a later step"
            )
        known = self.reductions.get(name)
        if known is None:
            if len(self.reductions) >= self.max_names:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning(
                        "probewire: user metric %r dropped: this rank logged %d names, the "
                        "most one run keeps (UserLog.max_names); further new names are "
                        "dropped and counted",
                        name,
                        self.max_names,
                    )
                return
            self.reductions[name] = known = reduction
        if known != reduction:
            raise ValueError(
                f"log({name!r}): logged with reduction {known!r} before, now {reduction!r}; "
                "one name keeps one reduction"
            )
        key = (name, step)
        if key not in self._pending and len(self._pending) >= 4 * self.max_names:
            self.dropped += 1  # values held for steps that never come: bounded too
            return
        self._pending.pop(key, None)  # the newest value last
        self._pending[key] = number

    def close(self, step: int, sent: bool) -> list[Point]:
        """Step ``step`` closed; when it is ``sent``, the points it carries: every value held
        for it, for an earlier step or for the next step (the newest value per name). A step
        not sent keeps them for the next one that is."""
        self.closed = max(self.closed, step)
        if not sent or not self._pending:
            return []
        due = [k for k in self._pending if k[1] is None or k[1] <= step]
        newest: dict[str, float] = {}
        for key in due:
            newest.pop(key[0], None)
            newest[key[0]] = self._pending.pop(key)
        return [
            p
            for name, value in newest.items()
            for p in points(name, value, self.reductions[name], self.rank)
        ]
