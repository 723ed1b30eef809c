"""The BOS value-gradient probe (002 bos_value_grad, attention): per block, ‖∂L/∂v‖² and
max |∂L/∂v| at valid BOS positions against the same sums at the other valid positions, in
the backward of every micro-batch of a scan step.

Every query that attends to BOS sends gradient into v_BOS, so an attention sink on BOS
shows as a BOS value gradient far above other positions'. The hook sits on the value
projection (or the V third of a fused QKV); with reentrant activation checkpointing the
graph exists only in the recomputation, where the gradient hook is placed instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..catalog import Attn, Label, tier_of
from ..discover import ValuePoint
from ..state import StepState
from ..wire import Point
from .common import F64, first_tensor, labels_of, recomputing
from .layout import StructureState

__all__ = ["decode_value_grad", "value_hook"]

TIER = tier_of(Attn.BOS_SUM_SQ, Attn.BOS_N, Attn.BOS_ABS_MAX, Attn.VALUE_SUM_SQ, Attn.VALUE_N)


def decode_value_grad(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    """[BOS Σg², BOS elements, BOS max|g|, other Σg², other elements] per layer part."""
    totals: dict[int, list[float]] = {}
    for values, layer in parts:
        v = values.tolist()
        t = totals.setdefault(layer, [0.0, 0.0, 0.0, 0.0, 0.0])
        t[0] += v[0]
        t[1] += v[1]
        t[2] = v[2] if math.isnan(v[2]) else max(t[2], v[2])
        t[3] += v[3]
        t[4] += v[4]
    out = []
    for layer, (bos_sq, bos_n, bos_max, sq, n) in sorted(totals.items()):
        lab = labels_of((Label.LAYER, layer))
        if bos_n > 0:
            out += [
                Point(Attn.BOS_SUM_SQ, bos_sq, lab),
                Point(Attn.BOS_N, bos_n, lab),
                Point(Attn.BOS_ABS_MAX, bos_max, lab),
            ]
        if n > 0:
            out += [Point(Attn.VALUE_SUM_SQ, sq, lab), Point(Attn.VALUE_N, n, lab)]
    return out


def value_hook(state: StepState, ctx: StructureState, value: ValuePoint, bos_id: int) -> Callable:
    """Forward hook of one value projection: places the gradient hook on its output."""
    key = id(value.module)

    def grad_hook(out: torch.Tensor) -> Callable:
        lead = tuple(out.shape[:-1])
        valid = ctx.valid(lead)
        bos_text = (ctx.ids == bos_id) if ctx.ids is not None else None
        bos = ctx.layout(lead, bos_text, False) if bos_text is not None else None

        def on_grad(grad: torch.Tensor) -> None:
            if not state.due[TIER]:
                return None
            g = grad.detach()
            if value.part is not None:
                g = g.chunk(3, dim=-1)[value.part]
            sq = g.float().square().sum(-1)
            peak = g.float().abs().amax(-1)
            ok = valid if valid is not None else torch.ones_like(sq, dtype=torch.bool)
            at_bos = ok & bos if bos is not None else torch.zeros_like(ok)
            other = ok & ~at_bos
            width = float(g.shape[-1])
            vec = torch.stack(
                [
                    torch.where(at_bos, sq, 0).sum(dtype=F64),
                    at_bos.sum(dtype=F64) * width,
                    torch.where(at_bos, peak, 0).amax().to(F64),
                    torch.where(other, sq, 0).sum(dtype=F64),
                    other.sum(dtype=F64) * width,
                ]
            )
            state.collector.add("structure.value_grad", vec, decode_value_grad, value.layer)
            return None

        return on_grad

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not state.due[TIER]:
            return None
        out = first_tensor(output)
        if out is None or out.dim() < 2:
            return None
        if recomputing():  # reentrant checkpointing: the graph exists only now
            if out.requires_grad and ctx.pending_values.get(key, 0) > 0:
                ctx.pending_values[key] -= 1
                out.register_hook(grad_hook(out))
            return None
        if out.requires_grad:
            out.register_hook(grad_hook(out))
        else:
            ctx.pending_values[key] = ctx.pending_values.get(key, 0) + 1
        return None

    return hook
