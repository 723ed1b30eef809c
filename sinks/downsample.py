"""Downsampling in SQL: a series over a visible x range, per bucket min, max and last.

A chart never needs more points than it has pixels, and a long run has more steps than
that: 200,000 steps of a panel are ~600 buckets of the visible range. Each bucket keeps its
minimum, its maximum and its last value with the x of each (never an average: a one-step
spike is a bucket's max and stays drawn). The bucket width comes from the visible range
(``lo``..``hi`` of the x column, as a client zooms), so zooming in reads finer buckets.

``downsample_sql`` builds the query (pure: text and parameters, no I/O); ``points``
turns one result row's aggregates into the (x, y) points a line draws, in x order. The
readers: ``probewire ui`` (``deploy.ui.queries``) and the Grafana panels.

The query reads ``table`` for the runs in ``{runs:Array(String)}``, x in
``[{lo:Float64}, {hi:Float64}]`` (and x > ``{after:Float64}`` for a live update), bucket
``least(floor((x - lo) / width), buckets - 1)``; per bucket and column ``c``:
``c__min``, ``c__max``, ``c__last`` (the value at the bucket's largest x where ``c`` is
finite) and their x (``c__xmin``, ``c__xmax``, ``c__xlast``). NULL, NaN and ±Inf are
not values (never drawn, never a min or a max). A bucket where a column has no value
gives that column's aggregates as NULL.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_POINTS",
    "POINTS_PER_BUCKET",
    "Window",
    "downsample_sql",
    "points",
    "window",
]

MAX_POINTS = 2000  # points one panel's series may return (a screen's width, twice over)
POINTS_PER_BUCKET = 3  # min, max, last
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PARTS = ("min", "max", "last", "xmin", "xmax", "xlast")


@dataclass(frozen=True, slots=True)
class Window:
    """The visible x range and its bucket width (``buckets`` buckets cover it)."""

    lo: float
    hi: float
    width: float
    buckets: int

    def parameters(self) -> dict[str, float | int]:
        return {"lo": self.lo, "hi": self.hi, "width": self.width, "buckets": self.buckets}


def window(lo: float, hi: float, *, integer: bool, max_points: int = MAX_POINTS) -> Window:
    """The window of ``[lo, hi]`` with at most ``max_points // 3`` buckets.

    ``integer`` x (steps): the width is a whole number of steps, at least 1 (a short
    range keeps every step). Otherwise (tokens, FLOPs) the range over the buckets.
    """
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi < lo:
        raise ValueError(f"the x range must be finite and ordered, got [{lo}, {hi}]")
    buckets = max(1, max_points // POINTS_PER_BUCKET)
    if integer:
        lo, hi = math.floor(lo), math.ceil(hi)
        width = float(max(1, math.ceil((hi - lo + 1) / buckets)))
    else:
        width = (hi - lo) / buckets if hi > lo else 1.0
    return Window(float(lo), float(hi), width, buckets)


def _name(text: str) -> str:
    if not _NAME.match(text):
        raise ValueError(f"not a column name: {text!r}")
    return text


def downsample_sql(
    table: str,
    columns: Sequence[str],
    *,
    x: str = "step",
    live: bool = False,
    final: bool = True,
    scale: Sequence[float] | None = None,
    group: str | None = None,
    subquery: str | None = None,
) -> str:
    """The query (see the module doc); its parameters are ``runs`` and the window's
    (``Window.parameters``), plus ``after`` when ``live``. ``table`` may be
    ``db.table``; ``scale`` divides each column (bytes → GiB) before it is aggregated.

    ``group``: a further key of the series (an expression, selected as ``series``: one
    series per source, say); ``subquery``: read this ``(SELECT ...)`` instead of
    ``table`` (both are the caller's own text, never a user's: only names are checked)."""
    db_table = ".".join(_name(part) for part in table.split("."))
    source = f"({subquery}) AS t" if subquery else db_table + (" FINAL" if final else "")
    x = _name(x)
    key = "run_id" + (", series" if group else "")
    factors = list(scale) if scale is not None else [1.0] * len(columns)
    if len(factors) != len(columns) or not all(f > 0 for f in factors):
        raise ValueError("one positive scale per column")
    selects = []
    for column, factor in zip(columns, factors):
        c = _name(column)
        v = f"({c} / {float(factor)!r})" if factor != 1.0 else c
        ok = f"isFinite(assumeNotNull({c})) AND isNotNull({c})"
        selects += [
            f"minIf({v}, {ok}) AS {c}__min",
            f"maxIf({v}, {ok}) AS {c}__max",
            f"argMaxIf({v}, {x}, {ok}) AS {c}__last",
            f"argMinIf({x}, {v}, {ok}) AS {c}__xmin",
            f"argMaxIf({x}, {v}, {ok}) AS {c}__xmax",
            f"maxIf({x}, {ok}) AS {c}__xlast",
            f"countIf({ok}) AS {c}__n",
        ]
    after = f" AND {x} > {{after:Float64}}" if live else ""
    return (
        f"SELECT run_id{f', {group} AS series' if group else ''}, least(toInt64(floor(({x} - {{lo:Float64}}) / {{width:Float64}})), "
        f"{{buckets:Int64}} - 1) AS bucket, max({x}) AS x, "
        + ", ".join(selects)
        + f" FROM {source}"
        f" WHERE run_id IN {{runs:Array(String)}} AND {x} >= {{lo:Float64}}"
        f" AND {x} <= {{hi:Float64}}{after}"
        f" GROUP BY {key}, bucket ORDER BY {key}, bucket"
    )


def points(row: dict[str, Any], column: str) -> list[tuple[float, float]]:
    """The (x, y) points of ``column`` in one bucket's row: its min, max and last at
    their x, in x order, each x once; none where the bucket has no value."""
    if not row.get(f"{column}__n"):
        return []
    out: dict[float, float] = {}
    for part in ("min", "max", "last"):
        xv = row[f"{column}__x{part}"]
        out[float(xv)] = float(row[f"{column}__{part}"])
    return sorted(out.items())
