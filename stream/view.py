"""The P0 view of one reduced step (seeds 001 §1-§8) and its detail rows: pure functions of
a ``ReducedStep``, no state, no I/O. Stage 2 calls them for each step it processes.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from operator import itemgetter
from typing import Any, NamedTuple

from probewire.instrument.catalog import (
    TENSOR_FIELDS,
    Comm,
    Grad,
    Group,
    Guard,
    Label,
    Loss,
    Memory,
    Modality,
    Moe,
    Optim,
    Output,
    Residual,
    System,
    Tensor,
)
from probewire.instrument.wire import Labels, SeriesKey

from .derive import (
    compute_rate,
    expert_balance,
    global_mean_loss,
    grad_norm,
    loss_by_group,
    mean_from_components,
    media_scale,
    own_time_ratios,
    own_times,
    rank_means,
    shard_imbalance,
    straggler_score,
    tokens_per_s,
    worst_rank_loss,
)
from .formed import by_name, formed_series
from .records import ReducedStep
from .signals import RankSeries

__all__ = [
    "GUARD_STEP",
    "PER_RANK",
    "P0View",
    "RankReads",
    "detail_rows",
    "p0_view",
    "rank_columns",
    "rank_reads",
]

GUARD_STEP = {
    Guard.SKIPPED: "skipped_step",
    Guard.REPLAYED: "replayed_step",
    Guard.REPLAY_MISMATCH: "replay_mismatch_step",
}
"""The spike guard's events of this step, by the view column holding them; stage 2 keeps
their cumulative counts (``skipped``, ``replayed``, ``replay_mismatch``) in its state."""

PER_RANK = frozenset(
    {Loss.SUM, Loss.TOKENS, System.STEP_TIME, Comm.WAIT, Memory.PEAK_ALLOCATED, Memory.PEAK_RSS}
)
"""The metrics whose per-rank values the view reads (any labels); the rest of a step's
per-rank values are detail only."""

_TENSOR_FIELD = dict(zip(Tensor.ALL, TENSOR_FIELDS))  # tensor.sum_sq -> sum_sq
_RATIO_SUM, _STREAM_NORM_SUM, _BRANCH_NORM_SUM = (
    Residual.name(stat, "sum") for stat in ("ratio", "stream_norm", "branch_norm")
)


@functools.lru_cache(maxsize=1 << 14)
def _tensor_slot(key: SeriesKey) -> tuple[str | None, str | None, str | None]:
    """A tensor statistic's ``tensor_stats`` column, tensor and kind; (None, ...) for a
    series of another metric."""
    field = _TENSOR_FIELD.get(key[0])
    if field is None:
        return None, None, None
    labels = dict(key[1])
    return field, labels.get(Label.TENSOR), labels.get(Label.KIND)


def _get(values: dict[SeriesKey, float], name: str, **labels: str) -> float | None:
    return values.get((name, tuple(sorted(labels.items()))))


def _labelled(names: dict[str, dict[Labels, float]], name: str) -> dict[tuple, float]:
    """``name``'s values with labels, from the step's values grouped by name (``by_name``)."""
    return {labels: v for labels, v in names.get(name, {}).items() if labels}


RankReads = dict[str, dict[Labels, dict[int, float]]]
"""A step's per-rank values of the view's metrics (``PER_RANK``) by name, label set and rank."""


def rank_reads(item: ReducedStep) -> RankReads:
    """One pass over the step's per-rank values: the view, the formed series and the
    detectors' rank series then look their metrics up instead of walking every value of
    every rank again (hundreds a step; the rest are detail only)."""
    out: RankReads = {}
    for rank, values in item.per_rank.items():
        read = _series_reads(tuple(values))
        if read.keys:  # the view's series among the rank's, by position
            row = read.positions(tuple(values.values()))
            for (name, labels), value in zip(read.keys, row if len(read.keys) > 1 else (row,)):
                out.setdefault(name, {}).setdefault(labels, {})[rank] = value
    return out


class _SeriesReads(NamedTuple):
    """What the view and the detail read of a rank's series, found once per series order
    (ranks send the same series in the same order step after step)."""

    keys: list[SeriesKey]  # the view's series (``PER_RANK``), in order...
    positions: Any  # ...their itemgetter in the rank's values
    names: list[str]  # every series' metric name...
    texts: list[str]  # ...and label text (``rank_metrics`` columns)


@functools.lru_cache(maxsize=64)
def _series_reads(series: tuple[SeriesKey, ...]) -> _SeriesReads:
    at = [i for i, (name, _) in enumerate(series) if name in PER_RANK]
    return _SeriesReads(
        [series[i] for i in at],
        itemgetter(*at) if at else None,
        [name for name, _ in series],
        ["|".join(f"{k}={v}" for k, v in labels) for _, labels in series],
    )


def _per_rank(reads: RankReads, name: str) -> dict[int, float]:
    """``name``'s unlabelled value per rank that reported it."""
    return reads.get(name, {}).get((), {})


def _rank_waits(reads: RankReads) -> dict[int, list[float]]:
    """The exposed collective waits (``comm.wait_s``, one per op) of each rank reporting any."""
    waits: dict[int, list[float]] = {}
    for by_rank in reads.get(Comm.WAIT, {}).values():
        for rank, value in by_rank.items():
            waits.setdefault(rank, []).append(value)
    return waits


def _straggler(own: dict[int, float], ratios: dict[int, float]) -> tuple[int | None, float | None]:
    """The rank with the largest own time (``derive.own_times``), and its own-time ratio
    (``derive.own_time_ratios``: over the median of the others; None with a single rank)."""
    if not own:
        return None, None
    rank = max(sorted(own), key=own.__getitem__)  # ties: the lowest rank
    return rank, ratios.get(rank)


def _rank_series(reads: RankReads, ratios: dict[int, float], worst: int | None) -> RankSeries:
    """Each rank's local mean loss L_r and own-time ratio, and each source's loss over the
    ranks other than ``worst``, for the detectors' culprit rules."""
    by_source: dict[str, tuple[list[float], list[float]]] = {}
    for index, name in enumerate((Loss.SUM, Loss.TOKENS)):
        for labels, by_rank in reads.get(name, {}).items():
            source = dict(labels).get(Label.SOURCE)
            if source is not None:
                by_source.setdefault(source, ([], []))[index].extend(
                    v for r, v in by_rank.items() if r != worst
                )
    return RankSeries(
        loss=rank_means(_per_rank(reads, Loss.SUM), _per_rank(reads, Loss.TOKENS)),
        own_ratio=ratios,
        source_loss_without_worst={  # sum, then divide (seeds 001 §3)
            s: math.fsum(sums) / math.fsum(counts)
            for s, (sums, counts) in by_source.items()
            if sums and math.fsum(counts) > 0
        },
    )


def _moe(item: ReducedStep, names: dict[str, dict[Labels, float]]) -> dict[str, Any]:
    """MaxVio / shard imbalance / H_norm from per-expert valid-token counts c_i (seeds §7)."""
    layers: dict[str, dict[int, float]] = defaultdict(dict)
    for labels, count in _labelled(names, Moe.EXPERT_TOKENS).items():
        lab = dict(labels)
        layers[lab[Label.LAYER]][int(lab[Label.EXPERT])] = count
    out: dict[str, Any] = {
        "moe_maxvio": None,
        "moe_maxvio_layer": None,
        "moe_shard_imbalance": None,
        "moe_h_norm": None,
    }
    ep = Group.EXPERT.value
    ep_size = len({r.get(ep, 0) for r in item.coords.values()}) if item.coords else 1
    for layer, by_expert in sorted(layers.items()):
        counts = [by_expert.get(i, 0.0) for i in range(max(by_expert) + 1)]
        balance = expert_balance(counts)
        if balance is None:  # no valid token reached the layer: no measurement
            continue
        if out["moe_maxvio"] is None or balance.max_violation > out["moe_maxvio"]:
            out["moe_maxvio"], out["moe_maxvio_layer"] = balance.max_violation, f"layer {layer}"
        if balance.entropy_norm is not None:
            out["moe_h_norm"] = (
                balance.entropy_norm
                if out["moe_h_norm"] is None
                else min(out["moe_h_norm"], balance.entropy_norm)
            )
        if ep_size > 1 and len(counts) % ep_size == 0:
            per = len(counts) // ep_size
            shard = shard_imbalance(counts, [i // per for i in range(len(counts))])
            if shard is not None:
                out["moe_shard_imbalance"] = max(out["moe_shard_imbalance"] or 0.0, shard)
    return out


def _residual(item: ReducedStep, names: dict[str, dict[Labels, float]]) -> dict[str, Any]:
    """The weakest residual branch: the smallest token-mean R_b = Σ ratio_sum / Σ tokens over
    (layer, branch), with its mean stream norm N_s and branch norm N_b (seeds 001 §8)."""
    red = item.reduced
    weakest: tuple[float, tuple, float | None, float | None] | None = None
    for labels, n in _labelled(names, Residual.TOKENS).items():
        ratio = red.get((_RATIO_SUM, labels))
        if not n > 0 or ratio is None or not math.isfinite(ratio):
            continue
        mean = mean_from_components(ratio, n)
        if weakest is None or mean < weakest[0]:
            norms = [red.get((name, labels)) for name in (_STREAM_NORM_SUM, _BRANCH_NORM_SUM)]
            weakest = (
                mean,
                labels,
                *(None if v is None else mean_from_components(v, n) for v in norms),
            )
    if weakest is None:
        return {
            "residual_ratio_min": None,
            "residual_ratio_branch": None,
            "residual_stream_norm": None,
            "residual_branch_norm": None,
        }
    lab = dict(weakest[1])
    return {
        "residual_ratio_min": weakest[0],
        "residual_ratio_branch": f"layer {lab.get(Label.LAYER, '?')} {lab.get(Label.BRANCH, '?')}",
        "residual_stream_norm": weakest[2],
        "residual_branch_norm": weakest[3],
    }


def _learning_rates(names: dict[str, dict[Labels, float]]) -> dict[str, Any]:
    """η per parameter group (label param_group) and the largest of them (``lr``)."""
    groups = {
        dict(labels).get(Label.PARAM_GROUP, ""): v
        for labels, v in _labelled(names, Optim.LR).items()
    }
    finite = [v for v in groups.values() if math.isfinite(v)]
    return {
        "lr": max(finite) if finite else (next(iter(groups.values())) if groups else None),
        "lr_groups": groups,
    }


class P0View(NamedTuple):
    """A step's P0 view (``view``: the step_metrics columns it forms), per data source
    (loss, share, tokens) (``sources``), and the per-rank series the detectors' culprit
    rules read (``ranks``)."""

    view: dict[str, Any]
    sources: dict[str, tuple[float, float, float]]
    ranks: RankSeries


def p0_view(item: ReducedStep) -> P0View:
    """The step's P0 values from its reduced components and the ranks' values."""
    red = item.reduced
    names = by_name(red)
    reads = rank_reads(item)
    waits = _rank_waits(reads)
    tokens = _get(red, Loss.TOKENS) or 0.0
    sums, counts = _per_rank(reads, Loss.SUM), _per_rank(reads, Loss.TOKENS)
    ranks = sorted(set(sums) & set(counts))
    worst = worst_rank_loss([sums[r] for r in ranks], [counts[r] for r in ranks])
    worst_id = None if worst is None else ranks[worst[1]]
    tau = _get(red, System.STEP_TIME)
    taus = _per_rank(reads, System.STEP_TIME)
    # own time: the step time less the rank's exposed wait (its finite waits summed)
    own = own_times(
        taus, {r: math.fsum(w for w in ws if math.isfinite(w)) for r, ws in waits.items()}
    )
    ratios = own_time_ratios(own)
    straggler_rank, own_ratio = _straggler(own, ratios)
    flops = _get(red, System.FLOPS)
    memory = _per_rank(reads, Memory.PEAK_ALLOCATED) or _per_rank(reads, Memory.PEAK_RSS)
    view: dict[str, Any] = {
        "step_tokens": int(tokens),
        "loss": global_mean_loss([_get(red, Loss.SUM) or 0.0], [tokens]),
        "loss_worst_rank": None if worst is None else worst[0],
        "loss_worst_rank_id": worst_id,
        "grad_norm": grad_norm(_get(red, Grad.NORM_SQ)),
        "clipped": _get(red, Grad.CLIPPED),
        "step_time_s": tau,
        "tokens_per_s": tokens_per_s(tokens, tau),
        "flops_step": flops,
        "compute_rate": compute_rate(flops, item.world_size, tau),
        "straggler_score": straggler_score(list(taus.values())) if taus else None,
        "straggler_rank": straggler_rank,
        "straggler_own_ratio": own_ratio,
        "peak_memory_bytes": max(memory.values()) if memory else None,
        "peak_memory_rank": max(memory, key=memory.__getitem__) if memory else None,
        "output_absmax": _get(red, Output.LOGITS_ABS_MAX),
        "media_scale": media_scale(
            *(
                _get(red, n)
                for n in (
                    Modality.MEDIA_SUM_SQ,
                    Modality.MEDIA_N,
                    Modality.TEXT_SUM_SQ,
                    Modality.TEXT_N,
                )
            )
        ),
        **{GUARD_STEP[name]: int(_get(red, name) or 0) for name in GUARD_STEP},
        "ranks_reporting": len(item.ranks_reporting),
        "ranks_missing": list(item.ranks_missing),
        "complete_reason": item.complete_reason,
        **_learning_rates(names),
        **_moe(item, names),
        **_residual(item, names),
        **formed_series(item, names, {r: math.fsum(ws) for r, ws in waits.items()}),
    }
    return P0View(view, _sources(names, tokens), _rank_series(reads, ratios, worst_id))


def _sources(
    names: dict[str, dict[Labels, float]], tokens: float
) -> dict[str, tuple[float, float, float]]:
    """Per data source: (L_mu, pi_mu, N_mu) of the sources with valid tokens (seeds §3)."""
    source_sums = _labelled(names, Loss.SUM)
    sums, counts = {}, {}
    for labels, count in _labelled(names, Loss.TOKENS).items():
        source = dict(labels).get(Label.SOURCE)
        if source is not None and count > 0 and labels in source_sums:
            sums[source], counts[source] = [source_sums[labels]], [count]
    return loss_by_group(sums, counts, total_tokens=tokens)


def rank_columns(item: ReducedStep) -> dict[str, list[Any]]:
    """The step's per-rank values as ``rank_metrics`` columns (one entry per rank, metric
    and label set), built with list extends: hundreds of values a step, no dict per value.
    Ranks usually send the same series in the same order: their names and label texts are
    made once and extended rank after rank."""
    # late: not part of the step's reduction (after its deadline, or a ring-buffer replay)
    late = int(item.complete_reason in ("late", "replay"))
    metrics: list[str] = []
    labels: list[str] = []
    ranks: list[int] = []
    values: list[float] = []
    for rank, vals in item.per_rank.items():
        read = _series_reads(tuple(vals))
        metrics += read.names
        labels += read.texts
        values += vals.values()
        ranks += [rank] * len(vals)
    n = len(values)
    return {
        "run_id": [item.run_id] * n,
        "step": [item.step] * n,
        "rank": ranks,
        "metric": metrics,
        "labels": labels,
        "value": values,
        "late": [late] * n,
    }


def detail_rows(item: ReducedStep) -> dict[str, list[dict[str, Any]]]:
    """The step's ``tensor_stats`` rows (one per tensor and kind with an element count) and
    ``expert_stats`` rows."""
    base = {"run_id": item.run_id, "step": item.step}
    tensors: dict[tuple, dict[str, Any]] = {}
    experts = []
    for key, value in item.reduced.items():
        field, tensor, kind = _tensor_slot(key)
        if field is not None:
            row = tensors.get((tensor, kind))
            if row is None:
                row = tensors[tensor, kind] = {
                    **base,
                    "tensor": tensor or "",
                    "kind": kind or "",
                    "sum3": None,
                    "sum4": None,
                }
            row[field] = value
            continue
        name, labels = key
        if name == Moe.EXPERT_TOKENS:
            lab = dict(labels)
            experts.append(
                {
                    **base,
                    "layer": lab[Label.LAYER],
                    "expert": int(lab[Label.EXPERT]),
                    "tokens": value,
                    "shard": int(lab.get(Label.SHARD, 0)),
                }
            )
    n = TENSOR_FIELDS[0]  # a tensor's row needs its element count
    return {"tensor_stats": [t for t in tensors.values() if n in t], "expert_stats": experts}
