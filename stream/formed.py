"""The series the seeds define that the P0 view forms beside its first-screen signals
(issue 18): gradient element statistics (all parameters and per group), the exposed
communication share, the update ratio, the output-logit series, the dead-expert ratio,
the encoder gradient share, MTP agreement, the BOS value gradient and the expert-bias sum.
Pure functions of a ``ReducedStep``; the arithmetic is ``derive``'s. A series whose
components the step lacks (not measured at this step's cadence) is None, never zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from probewire.instrument.catalog import (
    GRAD_GROUPS,
    Attn,
    Grad,
    Label,
    Modality,
    Moe,
    Output,
    System,
    Tensor,
)
from probewire.instrument.wire import Labels, SeriesKey

from .derive import (
    comm_wait_frac,
    dead_expert_ratio,
    grad_stats,
    ratio_from_components,
    rms_from_components,
    update_ratio,
)
from .records import ReducedStep

__all__ = ["by_name", "formed_series", "grad_group_rows"]

_GRAD = (Grad.ABS_SUM, Grad.ABS_MAX, Grad.ZEROS, Grad.ELEMENTS, Grad.NONFINITE)


def by_name(values: Mapping[SeriesKey, float]) -> dict[str, dict[Labels, float]]:
    """The values grouped by metric name, in one pass: each helper then looks its names up
    instead of scanning every series of the step again."""
    out: dict[str, dict[Labels, float]] = {}
    for (name, labels), value in values.items():
        found = out.get(name)
        if found is None:
            found = out[name] = {}
        found[labels] = value
    return out


def _sum(names: dict[str, dict[Labels, float]], name: str) -> float | None:
    """Σ of ``name`` over all its label sets (layers, depths, ...); None when absent."""
    found = names.get(name)
    return math.fsum(found.values()) if found else None


def _grad(values: dict[SeriesKey, float], labels: tuple) -> dict[str, Any]:
    stats = grad_stats(*(values.get((name, labels)) for name in _GRAD))
    return {
        "grad_abs_mean": stats and stats.abs_mean,
        "grad_abs_max": stats and stats.abs_max,
        "grad_zero_frac": stats and stats.zero_frac,
    }


def grad_group_rows(item: ReducedStep) -> list[dict[str, Any]]:
    """``grad_group_stats`` rows: G_mean, G_max, Z_g of each parameter group that reported
    gradient elements (embedding and expert parameters apart, seeds 001 §4)."""
    rows = []
    for group in GRAD_GROUPS:
        labels = ((Label.GROUP, group),)
        stats = _grad(item.reduced, labels)
        elements = item.reduced.get((Grad.ELEMENTS, labels))
        if elements:
            rows.append(
                {
                    "run_id": item.run_id,
                    "step": item.step,
                    "group": group,
                    "elements": int(elements),
                    **stats,
                }
            )
    return rows


def _update_ratio(names: dict[str, dict[Labels, float]]) -> float | None:
    """ρ over the tensors scanned both as kind=param and kind=update at this step."""
    by_kind: dict[str, dict[str, float]] = {"param": {}, "update": {}}
    for labels, v in names.get(Tensor.SUM_SQ, {}).items():
        lab = dict(labels)
        if lab.get(Label.KIND) in by_kind:
            by_kind[lab[Label.KIND]][lab.get(Label.TENSOR, "")] = v
    both = sorted(set(by_kind["param"]) & set(by_kind["update"]))
    if not both:
        return None
    return update_ratio(
        math.fsum(by_kind["update"][t] for t in both), math.fsum(by_kind["param"][t] for t in both)
    )


def _expert_layers(names: dict[str, dict[Labels, float]]) -> list[list[float]]:
    layers: dict[str, dict[int, float]] = {}
    for labels, v in names.get(Moe.EXPERT_TOKENS, {}).items():
        lab = dict(labels)
        layers.setdefault(lab[Label.LAYER], {})[int(lab[Label.EXPERT])] = v
    return [[by.get(i, 0.0) for i in range(max(by) + 1)] for by in layers.values()]


def formed_series(
    item: ReducedStep, names: dict[str, dict[Labels, float]], waits: Mapping[int, float]
) -> dict[str, Any]:
    """The step's formed series (the step_metrics columns of migration 4), from its reduced
    values, those grouped by name (``by_name``), and the exposed collective wait of each rank
    that reported one (``comm.wait_s`` summed over ops)."""
    red = item.reduced
    positions = red.get((Output.POSITIONS, ()))
    bos = rms_from_components(*(_sum(names, n) or 0.0 for n in (Attn.BOS_SUM_SQ, Attn.BOS_N)))
    other = rms_from_components(*(_sum(names, n) or 0.0 for n in (Attn.VALUE_SUM_SQ, Attn.VALUE_N)))
    logits = [red.get((n, ())) for n in (Output.LOGITS_SUM_SQ, Output.LOGITS_N)]
    return {
        **_grad(red, ()),
        "comm_wait_frac": comm_wait_frac(waits, red.get((System.STEP_TIME, ()))),
        "update_ratio": _update_ratio(names),
        "logits_rms": None if None in logits else rms_from_components(*logits),
        "top2_gap_mean": ratio_from_components(red.get((Output.TOP2_GAP_SUM, ())), positions),
        "top2_tie_frac": ratio_from_components(red.get((Output.TOP2_EQUAL, ())), positions),
        "dead_expert_ratio": dead_expert_ratio(_expert_layers(names)),
        "encoder_grad_share": ratio_from_components(
            red.get((Modality.ENCODER_GRAD_SQ, ())), red.get((Modality.ALL_GRAD_SQ, ()))
        ),
        "mtp_agreement": ratio_from_components(
            _sum(names, Output.MTP_AGREE), _sum(names, Output.MTP_POSITIONS)
        ),
        "bos_value_grad_rms": bos,
        "bos_value_grad_ratio": ratio_from_components(bos, other),
        "ep_bias_abs_sum": _sum(names, Moe.BIAS_ABS_SUM),
    }
