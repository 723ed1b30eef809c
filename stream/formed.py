"""The seeds' further series (issue 18) beside the P0 view's first-screen signals: the
registry's ``Kind.FORMED`` rows (``series``), by table. Pure functions of a ``ReducedStep``;
the arithmetic is ``derive``'s. A series whose components the step lacks (not measured at
this step's cadence) is None, never zero.
"""

from __future__ import annotations

from typing import Any

from probewire.instrument.catalog import GRAD_GROUPS, Grad, Label

from .inputs import StepInputs, by_name
from .records import ReducedStep
from .series import FORMED

__all__ = ["by_name", "formed_series", "grad_group_rows", "residual_rows"]

_STEP = tuple(f.series for f in FORMED if f.table == "step_metrics")
_GROUP = tuple(f.series for f in FORMED if f.table == "grad_group_stats")


def formed_series(item: ReducedStep) -> dict[str, Any]:
    """The step's further series (its ``step_metrics`` columns of ``Kind.FORMED``)."""
    s = StepInputs(item)
    return {c.name: c.formula(s) for c in _STEP}  # type: ignore[misc]


def grad_group_rows(item: ReducedStep) -> list[dict[str, Any]]:
    """``grad_group_stats`` rows: G_mean, G_max, Z_g of each parameter group that reported
    gradient elements (embedding and expert parameters apart, seeds 001 §4)."""
    s = StepInputs(item, names={}, reads={})  # group rows read reduced values only
    rows = []
    for group in GRAD_GROUPS:
        elements = s.get(Grad.ELEMENTS, **{Label.GROUP: group})
        if elements:
            rows.append(
                {
                    "run_id": item.run_id,
                    "step": item.step,
                    "group": group,
                    "elements": int(elements),
                    **{c.name: c.formula(s, **{Label.GROUP: group}) for c in _GROUP},  # type: ignore[misc]
                }
            )
    return rows


def residual_rows(s: StepInputs) -> list[dict[str, Any]]:
    """``residual_stats`` rows: each residual branch's token-mean R_b, N_s and N_b at a
    step that measures them (the depth profile; the weakest one is in ``step_metrics``)."""
    base = {"run_id": s.item.run_id, "step": s.item.step}
    return [
        {
            **base,
            "layer": b.layer,
            "branch": b.branch,
            "tokens": b.tokens,
            "ratio": b.ratio,
            "stream_norm": b.stream_norm,
            "branch_norm": b.branch_norm,
        }
        for b in s.branches
    ]
