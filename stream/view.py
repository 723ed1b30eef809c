"""The P0 view of one reduced step (seeds 001 §1-§8) and its detail rows: pure functions of
a ``ReducedStep``, no state, no I/O. Stage 2 calls them for each step it processes.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from typing import Any

from probewire.instrument.catalog import Comm, Label, Loss, Memory, Optim, System
from probewire.instrument.wire import SeriesKey

from .derive import (expert_balance, global_mean_loss, shard_imbalance, straggler_score,
                     worst_rank_loss)
from .records import ReducedStep

__all__ = ["PER_RANK", "p0_view"]

PER_RANK = frozenset({Loss.SUM, Loss.TOKENS, System.STEP_TIME, Comm.WAIT, Memory.PEAK_ALLOCATED,
                      Memory.PEAK_RSS})
"""The metrics whose per-rank values the view reads (any labels); the rest of a step's
per-rank values are detail only."""

_TENSOR_FIELDS = ("n", "sum", "sum_sq", "abs_sum", "abs_max", "zeros", "nonfinite", "sum3", "sum4")


def _get(values: dict[SeriesKey, float], name: str, **labels: str) -> float | None:
    return values.get((name, tuple(sorted(labels.items()))))


def _labelled(values: dict[SeriesKey, float], name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in values.items() if n == name and labels}


def _per_rank(item: ReducedStep, name: str) -> dict[int, float]:
    return {r: v[(name, ())] for r, v in item.per_rank.items() if (name, ()) in v}


def _own_times(item: ReducedStep) -> dict[int, float]:
    """Per rank, its own time: step time minus the exposed collective wait it reported
    (``comm.wait_s``, summed over ops; the step time itself when it reported none).

    Under synchronous data parallelism every rank's step time carries the slowest rank's
    delay (the others wait for it in the gradient all-reduce); their own time does not."""
    own: dict[int, float] = {}
    for rank, values in item.per_rank.items():
        tau = values.get(("step_time_s", ()))
        if tau is None:
            continue
        waits = [v for (name, _), v in values.items() if name == "comm.wait_s"
                 and math.isfinite(v)]
        own[rank] = max(tau - math.fsum(waits), 0.0) if waits else tau
    return own


def _straggler(item: ReducedStep) -> tuple[int | None, float | None]:
    """The rank with the largest own time, and S = its own time / the median own time of
    the other ranks (leave-one-out; None with a single rank)."""
    own = _own_times(item)
    if not own:
        return None, None
    rank = max(sorted(own), key=own.__getitem__)  # ties: the lowest rank
    others = [v for r, v in own.items() if r != rank]
    return rank, own[rank] / (statistics.median(others) + 1e-12) if others else None


def _moe(item: ReducedStep) -> dict[str, Any]:
    """MaxVio / shard imbalance / H_norm from per-expert valid-token counts c_i (seeds §7)."""
    layers: dict[str, dict[int, float]] = defaultdict(dict)
    for labels, count in _labelled(item.reduced, "moe.expert_tokens").items():
        lab = dict(labels)
        layers[lab["layer"]][int(lab["expert"])] = count
    out: dict[str, Any] = {"moe_maxvio": None, "moe_maxvio_layer": None,
                           "moe_shard_imbalance": None, "moe_h_norm": None}
    ep_size = len({r.get("ep", 0) for r in item.coords.values()}) if item.coords else 1
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


def _residual(item: ReducedStep) -> dict[str, Any]:
    """The weakest residual branch: the smallest token-mean R_b = Σ ratio_sum / Σ tokens over
    (layer, branch), with its mean stream norm N_s and branch norm N_b (seeds 001 §8)."""
    red = item.reduced
    weakest: tuple[float, tuple, float | None, float | None] | None = None
    for labels, n in _labelled(red, "residual.tokens").items():
        ratio = red.get(("residual.ratio_sum", labels))
        if not n > 0 or ratio is None or not math.isfinite(ratio):
            continue
        mean = ratio / n
        if weakest is None or mean < weakest[0]:
            norms = [red.get((f"residual.{stem}_sum", labels)) for stem in ("stream_norm",
                                                                             "branch_norm")]
            weakest = (mean, labels, *(None if v is None else v / n for v in norms))
    if weakest is None:
        return {"residual_ratio_min": None, "residual_ratio_branch": None,
                "residual_stream_norm": None, "residual_branch_norm": None}
    lab = dict(weakest[1])
    return {"residual_ratio_min": weakest[0],
            "residual_ratio_branch": f"layer {lab.get('layer', '?')} {lab.get('branch', '?')}",
            "residual_stream_norm": weakest[2], "residual_branch_norm": weakest[3]}


def _learning_rates(item: ReducedStep) -> dict[str, Any]:
    """η per parameter group (label param_group) and the largest of them (``lr``)."""
    groups = {dict(labels).get(Label.PARAM_GROUP, ""): v
              for labels, v in _labelled(item.reduced, Optim.LR).items()}
    finite = [v for v in groups.values() if math.isfinite(v)]
    return {"lr": max(finite) if finite else (next(iter(groups.values())) if groups else None),
            "lr_groups": groups}


def p0_view(item: ReducedStep) -> tuple[dict[str, Any], dict[str, tuple[float, float, float]]]:
    """The step's P0 values from its reduced components, and per-source (loss, share, tokens)."""
    red = item.reduced
    tokens = _get(red, "loss.tokens") or 0.0
    sums, counts = _per_rank(item, "loss.sum"), _per_rank(item, "loss.tokens")
    ranks = sorted(set(sums) & set(counts))
    worst = worst_rank_loss([sums[r] for r in ranks], [counts[r] for r in ranks])
    grad_sq = _get(red, "grad.norm_sq")
    tau = _get(red, "step_time_s")
    straggler_rank, own_ratio = _straggler(item)
    taus = _per_rank(item, "step_time_s")
    flops = _get(red, "flops.step")
    memory = _per_rank(item, "memory.peak_allocated_bytes") or _per_rank(
        item, "memory.peak_rss_bytes")
    media = [_get(red, f"modality.{n}") for n in ("media_sum_sq", "media_n", "text_sum_sq",
                                                   "text_n")]
    view: dict[str, Any] = {
        "step_tokens": int(tokens),
        "loss": global_mean_loss([_get(red, "loss.sum") or 0.0], [tokens]),
        "loss_worst_rank": None if worst is None else worst[0],
        "loss_worst_rank_id": None if worst is None else ranks[worst[1]],
        "grad_norm": None if grad_sq is None else (math.sqrt(grad_sq) if grad_sq >= 0
                                                   else math.nan),
        "clipped": _get(red, "grad.clipped"),
        "step_time_s": tau,
        "tokens_per_s": tokens / tau if tau else None,
        "flops_step": flops,
        "compute_rate": flops / (item.world_size * tau) if flops is not None and tau else None,
        "straggler_score": straggler_score(list(taus.values())) if taus else None,
        "straggler_rank": straggler_rank,
        "straggler_own_ratio": own_ratio,
        "peak_memory_bytes": max(memory.values()) if memory else None,
        "peak_memory_rank": max(memory, key=memory.__getitem__) if memory else None,
        "output_absmax": _get(red, "output.logits_abs_max"),
        "media_scale": math.sqrt(media[0] / media[1]) / (math.sqrt(media[2] / media[3]) + 1e-12)
        if None not in media and media[1] and media[3] else None,
        "skipped": int(_get(red, "guard.skipped") or 0),
        "replayed": int(_get(red, "guard.replayed") or 0),
        "replay_mismatch": int(_get(red, "guard.replay_mismatch") or 0),
        "ranks_reporting": len(item.ranks_reporting),
        "ranks_missing": list(item.ranks_missing),
        "complete_reason": item.complete_reason,
        **_learning_rates(item),
        **_moe(item),
        **_residual(item),
    }
    sources = {}
    source_sums = _labelled(red, "loss.sum")
    for labels, count in _labelled(red, "loss.tokens").items():
        lab = dict(labels)
        if "source" in lab and count > 0 and labels in source_sums:
            sources[lab["source"]] = (source_sums[labels] / count,
                                      count / tokens if tokens else math.nan, count)
    return view, sources


def _detail_rows(item: ReducedStep) -> dict[str, list[dict[str, Any]]]:
    base = {"run_id": item.run_id, "step": item.step}
    run_id, step, late = item.run_id, item.step, int(item.complete_reason == "late")
    texts: dict[tuple, str] = {}  # every rank sends the same label sets: join each once
    for vals in item.per_rank.values():
        for _, lab in vals:
            if lab not in texts:
                texts[lab] = "|".join(f"{k}={v}" for k, v in lab)
    ranks = [{"run_id": run_id, "step": step, "rank": r, "metric": name, "labels": texts[lab],
              "value": value, "late": late}
             for r, vals in item.per_rank.items() for (name, lab), value in vals.items()]
    tensors: dict[tuple, dict[str, Any]] = {}
    experts = []
    for (name, labels), value in item.reduced.items():
        if name.startswith("tensor.") and name[7:] in _TENSOR_FIELDS:
            lab = dict(labels)
            row = tensors.setdefault((lab.get("tensor"), lab.get("kind")), {
                **base, "tensor": lab.get("tensor", ""), "kind": lab.get("kind", ""),
                "sum3": None, "sum4": None})
            row[name[7:]] = value
        elif name == "moe.expert_tokens":
            lab = dict(labels)
            experts.append({**base, "layer": lab["layer"], "expert": int(lab["expert"]),
                            "tokens": value, "shard": int(lab.get("shard", 0))})
    return {"rank_metrics": ranks, "tensor_stats": [t for t in tensors.values() if "n" in t],
            "expert_stats": experts}
