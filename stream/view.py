"""The P0 view of one reduced step (seeds 001 §1-§8) and its detail rows: pure functions of
a ``ReducedStep``, no state, no I/O. Stage 2 calls them for each step it processes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from probewire.instrument.catalog import (TENSOR_FIELDS, Comm, Grad, Group, Guard, Label, Loss,
                                          Memory, Modality, Moe, Optim, Output, Residual,
                                          System, Tensor)
from probewire.instrument.wire import Labels, SeriesKey

from .derive import (compute_rate, expert_balance, global_mean_loss, grad_norm, loss_by_group,
                     mean_from_components, media_scale, own_time_ratios, own_times, rank_means,
                     shard_imbalance, straggler_score, tokens_per_s, worst_rank_loss)
from .formed import by_name, formed_series
from .records import ReducedStep
from .signals import RankSeries

__all__ = ["GUARD_STEP", "PER_RANK", "detail_rows", "p0_view", "rank_columns", "rank_series"]

GUARD_STEP = {Guard.SKIPPED: "skipped_step", Guard.REPLAYED: "replayed_step",
              Guard.REPLAY_MISMATCH: "replay_mismatch_step"}
"""The spike guard's events of this step, by the view column holding them; stage 2 keeps
their cumulative counts (``skipped``, ``replayed``, ``replay_mismatch``) in its state."""

PER_RANK = frozenset({Loss.SUM, Loss.TOKENS, System.STEP_TIME, Comm.WAIT, Memory.PEAK_ALLOCATED,
                      Memory.PEAK_RSS})
"""The metrics whose per-rank values the view reads (any labels); the rest of a step's
per-rank values are detail only."""

_TENSOR_FIELD = dict(zip(Tensor.ALL, TENSOR_FIELDS))  # tensor.sum_sq -> sum_sq
_RATIO_SUM, _STREAM_NORM_SUM, _BRANCH_NORM_SUM = (
    Residual.name(stat, "sum") for stat in ("ratio", "stream_norm", "branch_norm"))


def _get(values: dict[SeriesKey, float], name: str, **labels: str) -> float | None:
    return values.get((name, tuple(sorted(labels.items()))))


def _labelled(names: dict[str, dict[Labels, float]], name: str) -> dict[tuple, float]:
    """``name``'s values with labels, from the step's values grouped by name (``by_name``)."""
    return {labels: v for labels, v in names.get(name, {}).items() if labels}


def _per_rank(item: ReducedStep, name: str) -> dict[int, float]:
    return {r: v[(name, ())] for r, v in item.per_rank.items() if (name, ()) in v}


def _own_times(item: ReducedStep) -> dict[int, float]:
    """Per rank, its own time: step time minus the exposed collective wait it reported
    (``comm.wait_s``, summed over ops), the wait clamped into [0, step time] and the own
    time floored (``derive.own_times``).

    Under synchronous data parallelism every rank's step time carries the slowest rank's
    delay (the others wait for it in the gradient all-reduce); their own time does not."""
    taus = _per_rank(item, System.STEP_TIME)
    waits = {rank: math.fsum(v for (name, _), v in values.items()
                             if name == Comm.WAIT and math.isfinite(v))
             for rank, values in item.per_rank.items()}
    return own_times(taus, waits)


def _straggler(item: ReducedStep) -> tuple[int | None, float | None]:
    """The rank with the largest own time, and its own time / the median own time of the
    other ranks (leave-one-out; None with a single rank)."""
    own = _own_times(item)
    if not own:
        return None, None
    rank = max(sorted(own), key=own.__getitem__)  # ties: the lowest rank
    return rank, own_time_ratios(own).get(rank)


def rank_series(item: ReducedStep, worst: int | None) -> RankSeries:
    """Each rank's local mean loss L_r and own-time ratio, and each source's loss over the
    ranks other than ``worst``, for the detectors' culprit rules."""
    sums: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[float]] = defaultdict(list)
    for rank, values in item.per_rank.items():
        if rank == worst:
            continue
        for (name, labels), value in values.items():
            source = dict(labels).get(Label.SOURCE) if name in (Loss.SUM, Loss.TOKENS) \
                else None
            if source is not None:
                (sums if name == Loss.SUM else counts)[source].append(value)
    return RankSeries(loss=rank_means(_per_rank(item, Loss.SUM), _per_rank(item, Loss.TOKENS)),
                      own_ratio=own_time_ratios(_own_times(item)),
                      source_loss_without_worst={  # sum, then divide (seeds 001 §3)
                          s: math.fsum(sums[s]) / math.fsum(counts[s]) for s in sums
                          if math.fsum(counts.get(s, ())) > 0})


def _moe(item: ReducedStep, names: dict[str, dict[Labels, float]]) -> dict[str, Any]:
    """MaxVio / shard imbalance / H_norm from per-expert valid-token counts c_i (seeds §7)."""
    layers: dict[str, dict[int, float]] = defaultdict(dict)
    for labels, count in _labelled(names, Moe.EXPERT_TOKENS).items():
        lab = dict(labels)
        layers[lab[Label.LAYER]][int(lab[Label.EXPERT])] = count
    out: dict[str, Any] = {"moe_maxvio": None, "moe_maxvio_layer": None,
                           "moe_shard_imbalance": None, "moe_h_norm": None}
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
            out["moe_h_norm"] = balance.entropy_norm if out["moe_h_norm"] is None \
                else min(out["moe_h_norm"], balance.entropy_norm)
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
            weakest = (mean, labels, *(None if v is None else mean_from_components(v, n)
                                       for v in norms))
    if weakest is None:
        return {"residual_ratio_min": None, "residual_ratio_branch": None,
                "residual_stream_norm": None, "residual_branch_norm": None}
    lab = dict(weakest[1])
    return {"residual_ratio_min": weakest[0],
            "residual_ratio_branch": f"layer {lab.get(Label.LAYER, '?')} "
                                     f"{lab.get(Label.BRANCH, '?')}",
            "residual_stream_norm": weakest[2], "residual_branch_norm": weakest[3]}


def _learning_rates(names: dict[str, dict[Labels, float]]) -> dict[str, Any]:
    """η per parameter group (label param_group) and the largest of them (``lr``)."""
    groups = {dict(labels).get(Label.PARAM_GROUP, ""): v
              for labels, v in _labelled(names, Optim.LR).items()}
    finite = [v for v in groups.values() if math.isfinite(v)]
    return {"lr": max(finite) if finite else (next(iter(groups.values())) if groups else None),
            "lr_groups": groups}


def p0_view(item: ReducedStep) -> tuple[dict[str, Any], dict[str, tuple[float, float, float]]]:
    """The step's P0 values from its reduced components, and per-source (loss, share, tokens)."""
    red = item.reduced
    names = by_name(red)
    tokens = _get(red, Loss.TOKENS) or 0.0
    sums, counts = _per_rank(item, Loss.SUM), _per_rank(item, Loss.TOKENS)
    ranks = sorted(set(sums) & set(counts))
    worst = worst_rank_loss([sums[r] for r in ranks], [counts[r] for r in ranks])
    tau = _get(red, System.STEP_TIME)
    straggler_rank, own_ratio = _straggler(item)
    taus = _per_rank(item, System.STEP_TIME)
    flops = _get(red, System.FLOPS)
    memory = _per_rank(item, Memory.PEAK_ALLOCATED) or _per_rank(item, Memory.PEAK_RSS)
    view: dict[str, Any] = {
        "step_tokens": int(tokens),
        "loss": global_mean_loss([_get(red, Loss.SUM) or 0.0], [tokens]),
        "loss_worst_rank": None if worst is None else worst[0],
        "loss_worst_rank_id": None if worst is None else ranks[worst[1]],
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
        "media_scale": media_scale(*(_get(red, n) for n in (
            Modality.MEDIA_SUM_SQ, Modality.MEDIA_N, Modality.TEXT_SUM_SQ, Modality.TEXT_N))),
        **{GUARD_STEP[name]: int(_get(red, name) or 0) for name in GUARD_STEP},
        "ranks_reporting": len(item.ranks_reporting),
        "ranks_missing": list(item.ranks_missing),
        "complete_reason": item.complete_reason,
        **_learning_rates(names),
        **_moe(item, names),
        **_residual(item, names),
        **formed_series(item),
    }
    return view, _sources(names, tokens)


def _sources(names: dict[str, dict[Labels, float]],
             tokens: float) -> dict[str, tuple[float, float, float]]:
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
    and label set), built with list extends: hundreds of values a step, no dict per value."""
    # late: not part of the step's reduction (after its deadline, or a ring-buffer replay)
    late = int(item.complete_reason in ("late", "replay"))
    texts: dict[tuple, str] = {}  # every rank sends the same label sets: join each once
    keys: list[SeriesKey] = []
    ranks: list[int] = []
    values: list[float] = []
    for rank, vals in item.per_rank.items():
        keys += vals.keys()
        values += vals.values()
        ranks += [rank] * len(vals)
    for _, lab in keys:
        if lab not in texts:
            texts[lab] = "|".join(f"{k}={v}" for k, v in lab)
    n = len(keys)
    return {"run_id": [item.run_id] * n, "step": [item.step] * n, "rank": ranks,
            "metric": [name for name, _ in keys], "labels": [texts[lab] for _, lab in keys],
            "value": values, "late": [late] * n}


def detail_rows(item: ReducedStep) -> dict[str, list[dict[str, Any]]]:
    """The step's ``tensor_stats`` rows (one per tensor and kind with an element count) and
    ``expert_stats`` rows."""
    base = {"run_id": item.run_id, "step": item.step}
    tensors: dict[tuple, dict[str, Any]] = {}
    experts = []
    for (name, labels), value in item.reduced.items():
        field = _TENSOR_FIELD.get(name)
        if field is not None:
            lab = dict(labels)
            row = tensors.setdefault((lab.get(Label.TENSOR), lab.get(Label.KIND)), {
                **base, "tensor": lab.get(Label.TENSOR, ""), "kind": lab.get(Label.KIND, ""),
                "sum3": None, "sum4": None})
            row[field] = value
        elif name == Moe.EXPERT_TOKENS:
            lab = dict(labels)
            experts.append({**base, "layer": lab[Label.LAYER], "expert": int(lab[Label.EXPERT]),
                            "tokens": value, "shard": int(lab.get(Label.SHARD, 0))})
    n = TENSOR_FIELDS[0]  # a tensor's row needs its element count
    return {"tensor_stats": [t for t in tensors.values() if n in t], "expert_stats": experts}
