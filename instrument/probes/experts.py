"""Expert probes (seeds 001 §7, 002 moe/*): valid tokens per expert on every step; Σ|b| of
the router's selection bias on scan steps; the bias values and the top-k margin
distribution on demand.

Device side: per-expert counts of the router's chosen ids over valid tokens (a token counts
once per chosen expert; padding adds nothing), the gap s_(k) − s_(k+1) per token, Σ|b|.
Host side: moe.expert_tokens for every expert of a layer that saw a valid token (a layer
that saw none sends nothing), router bias values, margin token blocks. The stream forms
MaxVio, I, H_norm, shard imbalance and the dead-expert ratio from the summed counts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..catalog import Label, Moe, tier_of
from ..discover import RouterPoint
from ..parallel import expert_shards
from ..state import StepState
from ..wire import Point
from .common import F64, labels_of, recomputing
from .layout import StructureState
from .tokens import TokenField, token_quantiles

__all__ = [
    "decode_experts",
    "decode_margin",
    "decode_router_bias",
    "expert_bias_abs_sum",
    "expert_placement",
    "expert_token_counts",
    "finish_margins",
    "router_hook",
    "topk_margin",
]

log = logging.getLogger(__name__)

COUNTS_TIER = tier_of(Moe.EXPERT_TOKENS)
ROUTING_TIER = tier_of(
    Moe.ROUTER_BIAS,
    Moe.MARGIN_TOKENS,
    Moe.MARGIN_SUM,
    Moe.MARGIN_P90,
    Moe.MARGIN_P99,
    Moe.MARGIN_MAX,
    Moe.MARGIN_P10,
    Moe.MARGIN_MIN,
)
BIAS_SUM_TIER = tier_of(Moe.BIAS_ABS_SUM)
Parts = list[tuple[np.ndarray, Any]]


# ------------------------------------------------------------------ device arithmetic
def _masked_bincount(ids: torch.Tensor, valid: torch.Tensor, size: int) -> torch.Tensor:
    """Counts of ``ids`` [T, k] over rows with ``valid`` [T]; fixed output shape [size]."""
    keep = valid.reshape(-1, 1).expand_as(ids)
    safe = torch.where(keep, ids, 0).reshape(-1)
    counts = torch.zeros(size, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, safe, keep.reshape(-1).to(torch.int64))


def expert_token_counts(
    topk_indices: torch.Tensor, valid: torch.Tensor, n_experts: int
) -> torch.Tensor:
    """Valid tokens routed to each expert c_i, int64 [E] (§7: MaxVio, I P0; H_norm P1).

    Measurement point: the router's chosen expert ids [..., k] of one MoE layer and
    micro-batch. A token counts once for each of its k experts (Σ c_i = k · valid tokens).
    Invalid tokens (``valid`` [...] false, e.g. padding) add nothing whatever index they
    carry; a valid index outside [0, E) is an error.
    """
    k = topk_indices.shape[-1]
    return _masked_bincount(topk_indices.reshape(-1, k), valid.reshape(-1), n_experts)


def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per-token gap s_(k) − s_(k+1) of the k-th and (k+1)-th score, float32 [T] (§7, P2).

    ``scores`` [..., E] are whatever the router ranks to select experts (logits,
    probabilities, or bias-adjusted scores). Summarise with ``token_quantiles(m, valid)``.
    """
    if not 1 <= k < scores.shape[-1]:
        raise ValueError(f"need 1 <= k < n_experts, got k={k}, n_experts={scores.shape[-1]}")
    top = scores.detach().reshape(-1, scores.shape[-1]).float().topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def expert_bias_abs_sum(bias: torch.Tensor) -> torch.Tensor:
    """Σ_i |bias_i| of a router's expert bias, float64 0-dim (002, moe/ep_bias_abs_sum)."""
    return bias.detach().to(torch.float64).abs().sum()


def expert_placement(moe: nn.Module | None, n_experts: int) -> tuple[int, ...] | None:
    """Each expert's expert-parallel shard, from the global ids of the experts this rank
    holds: the MoE module's ``local_expert_indices`` (as Megatron-core names them), read once
    at attach (``parallel.expert_shards``). None without them (no shard label: the stream
    then assumes contiguous placement); a warning when they fit no known placement."""
    owned = getattr(moe, "local_expert_indices", None)
    if owned is None:
        return None
    shards = expert_shards(owned, n_experts)
    if shards is None and 0 < len(owned) < n_experts:
        log.warning(
            "probewire: local_expert_indices %s of %d experts are neither contiguous nor "
            "strided; moe.expert_tokens is sent without a shard",
            list(owned),
            n_experts,
        )
    return shards


# ------------------------------------------------------------------ host decoding
def decode_experts(parts: Parts) -> list[Point]:
    """moe.expert_tokens{layer, expert}: every expert of a layer that saw a valid token,
    with its expert-parallel ``shard`` where the layer's placement is known (meta: the
    layer and ``parallel.expert_shards`` or None)."""
    totals: dict[Any, np.ndarray] = {}
    placement: dict[Any, tuple[int, ...] | None] = {}
    for values, (layer, shards) in parts:
        totals[layer] = totals.get(layer, 0) + values
        placement[layer] = shards
    out = []
    for layer, counts in sorted(totals.items()):
        if counts.sum() > 0:  # a layer that received no valid token records nothing
            shards = placement[layer]
            out += [
                Point(
                    Moe.EXPERT_TOKENS,
                    float(c),
                    labels_of(
                        (Label.LAYER, layer),
                        (Label.EXPERT, i),
                        *(() if shards is None else ((Label.SHARD, shards[i]),)),
                    ),
                )
                for i, c in enumerate(counts.tolist())
            ]
    return out


def decode_router_bias(parts: Parts) -> list[Point]:
    """moe.expert_bias_abs_sum{layer} (P1, scan steps) and, on demand steps, the bias values
    moe.router_bias{layer, expert} before it in the part."""
    out = []
    for values, layer in parts:
        bias, total = values[:-1].tolist(), float(values[-1])
        out += [
            Point(Moe.ROUTER_BIAS, v, labels_of((Label.LAYER, layer), (Label.EXPERT, i)))
            for i, v in enumerate(bias)
        ]
        out.append(Point(Moe.BIAS_ABS_SUM, total, labels_of((Label.LAYER, layer))))
    return out


def decode_margin(parts: Parts) -> list[Point]:
    out = []
    for values, layer in parts:
        block = values.reshape(2, len(TokenField))
        count = block[0, TokenField.COUNT]
        if not count > 0:
            continue
        lab = labels_of((Label.LAYER, layer))
        up, down = block[0].tolist(), block[1].tolist()
        out += [
            Point(Moe.MARGIN_TOKENS, count, lab),
            Point(Moe.MARGIN_SUM, up[TokenField.SUM], lab),
            Point(Moe.MARGIN_P90, up[TokenField.P90], lab),
            Point(Moe.MARGIN_P99, up[TokenField.P99], lab),
            Point(Moe.MARGIN_MAX, up[TokenField.MAX], lab),
            Point(Moe.MARGIN_P10, -down[TokenField.P90], lab),
            Point(Moe.MARGIN_MIN, -down[TokenField.MAX], lab),
        ]
    return out


# ------------------------------------------------------------------ hooks
def _router_output(
    output: Any, router: RouterPoint
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(top-k expert ids [N, k] or None, selection scores [N, E] or None) of a router call."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    ids = next(
        (
            t
            for t in items
            if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() >= 1
        ),
        None,
    )
    scores = next(
        (
            t
            for t in items
            if isinstance(t, torch.Tensor)
            and t.is_floating_point()
            and t.dim() >= 1
            and t.shape[-1] == router.n_experts
        ),
        None,
    )
    if ids is None and router.top_k is None:
        return None, None
    return ids, scores.detach() if scores is not None else None


def router_hook(
    state: StepState,
    ctx: StructureState,
    router: RouterPoint,
    shards: tuple[int, ...] | None = None,
) -> Callable:
    """Expert counts of one MoE layer per micro-batch (labelled with each expert's
    expert-parallel shard, ``shards``, where known); on demand its margins and bias."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if (
            not (state.due[COUNTS_TIER] or state.due[ROUTING_TIER] or state.due[BIAS_SUM_TIER])
            or recomputing()
        ):
            return None
        ids, scores = _router_output(output, router)
        if ids is None and scores is None:
            return None
        if router.bias is not None and scores is not None:
            scores = scores.detach().float() + router.bias.detach().float()
        if ids is None:
            ids = scores.topk(router.top_k or 1, dim=-1).indices  # type: ignore[union-attr]
        valid = ctx.valid_flat(ids)
        if state.due[COUNTS_TIER]:
            counts = expert_token_counts(ids, valid, router.n_experts)
            meta = (router.layer, shards)
            state.collector.add("structure.experts", counts, decode_experts, meta)
        if state.due[ROUTING_TIER] and scores is not None and ids.shape[-1] < router.n_experts:
            margin = topk_margin(scores, ids.shape[-1])
            ctx.margins.setdefault(router.layer, []).append(
                (torch.stack([margin, -margin], dim=-1), valid)
            )
        if (
            router.bias is not None
            and id(module) not in ctx.once
            and (state.due[BIAS_SUM_TIER] or state.due[ROUTING_TIER])
        ):
            ctx.once.add(id(module))
            bias = router.bias.detach().to(F64)
            total = expert_bias_abs_sum(bias).reshape(1)
            state.collector.add(
                "structure.router_bias",
                [bias, total] if state.due[ROUTING_TIER] else [total],
                decode_router_bias,
                router.layer,
            )
        return None

    return hook


def finish_margins(state: StepState, ctx: StructureState) -> None:
    """The step's margin token blocks: the "higher" quantiles over all its micro-batches."""
    for layer, parts in ctx.margins.items():
        values = torch.cat([v for v, _ in parts])
        valid = torch.cat([ok for _, ok in parts])
        block = token_quantiles(values, valid, method="higher")
        state.collector.add("structure.margin", block, decode_margin, layer)
