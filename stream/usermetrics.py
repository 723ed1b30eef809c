"""A reduced step's user metrics (``Monitor.log``, instrument/userlog.py) as
``user_metrics`` rows: one per name, with the reduction the user declared.

Stage 1 reduced each point by its catalog metric's rule (``User``); here the mean's two
sums become the mean over ranks, Σ value / Σ ranks. A NaN or ±inf reduced value is stored
as it is (a diverging evaluation is what it measures). A name the ranks sent under two
reductions in one step (each rank keeps one reduction per name, but two ranks may differ)
has no value: it is stored as NaN with reduction ``mixed``, so the mistake shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from probewire.instrument.catalog import Label, User
from probewire.instrument.wire import SeriesKey

__all__ = ["user_rows", "user_values"]

_REDUCTION = {User.SUM: "sum", User.MAX: "max", User.FIRST: "rank0"}


def user_values(reduced: Mapping[SeriesKey, float]) -> dict[str, tuple[float, str]]:
    """{name: (value, reduction)} of one reduced step, in name order."""
    out: dict[str, tuple[float, str]] = {}
    for (metric, labels), value in reduced.items():
        if metric not in _REDUCTION and metric != User.MEAN:
            continue
        name = dict(labels).get(Label.NAME)
        if name is None:
            continue
        if metric == User.MEAN:
            ranks = reduced.get((User.RANKS, labels), 0.0)
            got = (value / ranks if ranks > 0 else float("nan"), "mean")
        else:
            got = (value, _REDUCTION[metric])
        out[name] = (float("nan"), "mixed") if name in out else got
    return dict(sorted(out.items()))


def user_rows(run_id: str, step: int, reduced: Mapping[SeriesKey, float]) -> list[dict[str, Any]]:
    """The ``user_metrics`` rows of one reduced step."""
    return [
        {"run_id": run_id, "step": step, "name": name, "value": value, "reduction": reduction}
        for name, (value, reduction) in user_values(reduced).items()
    ]
