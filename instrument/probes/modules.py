"""Per-module views of 002 (on demand): the weight gradient of each parameter role per block
(Σg², elements, max |g|; a fused QKV split into Q, K, V; stacked experts summed over the
layer's experts), and the attention core output and gate scores (Σx², elements over valid
positions). The stream forms RMS = sqrt(Σ sum_sq / Σ n) from them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..catalog import Label, Module, tier_of
from ..discover import ModuleView, ParamView
from ..parallel import local
from ..state import StepState
from ..wire import Point
from .common import F64, first_tensor, labels_of, recomputing
from .layout import StructureState

__all__ = ["ModuleGrads", "activation_hook", "decode_module_acts", "decode_module_grads"]

GRAD_TIER = tier_of(Module.GRAD_SUM_SQ, Module.GRAD_N, Module.GRAD_ABS_MAX)
ACT_TIER = tier_of(Module.ACT_SUM_SQ, Module.ACT_N)


def decode_module_grads(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    values, metas = parts[0]
    rows = values.reshape(-1, 2)
    totals: dict[tuple[Any, str], list[float]] = {}
    for (layer, role, n), (sq, peak) in zip(metas, rows.tolist()):
        t = totals.setdefault((layer, role), [0.0, 0.0, 0.0])
        t[0] += sq
        t[1] += n
        t[2] = peak if math.isnan(peak) else max(t[2], peak)
    out = []
    for (layer, role), (sq, n, peak) in totals.items():
        lab = (
            labels_of((Label.MODULE, role))
            if layer is None
            else labels_of((Label.LAYER, layer), (Label.MODULE, role))
        )
        out += [
            Point(Module.GRAD_SUM_SQ, sq, lab),
            Point(Module.GRAD_N, n, lab),
            Point(Module.GRAD_ABS_MAX, peak, lab),
        ]
    return out


def decode_module_acts(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    totals: dict[tuple[int, str], list[float]] = {}
    for values, key in parts:
        t = totals.setdefault(key, [0.0, 0.0])
        t[0] += float(values[0])
        t[1] += float(values[1])
    out = []
    for (layer, role), (sq, n) in sorted(totals.items()):
        if n > 0:
            lab = labels_of((Label.LAYER, layer), (Label.MODULE, role))
            out += [Point(Module.ACT_SUM_SQ, sq, lab), Point(Module.ACT_N, n, lab)]
    return out


class ModuleGrads:
    """The per-role gradient views at the gradient point (inv_scale removes a loss scale)."""

    def __init__(self, views: list[ParamView]) -> None:
        self._views = views

    def record(self, state: StepState, inv_scale: Any) -> None:
        if not state.due[GRAD_TIER]:
            return
        rows, metas = [], []
        for view in self._views:
            grad = view.param.grad
            if grad is None:
                continue
            g = local(grad).detach()
            if view.part is not None:
                g = g.chunk(view.parts, dim=view.dim)[view.part]
            g = g.float()
            rows.append(torch.stack([g.square().sum(dtype=F64), g.abs().amax().to(F64)]))
            metas.append((view.layer, view.role, float(g.numel())))
        if rows:
            stacked = torch.stack(rows)
            if inv_scale is not None:
                inv = torch.as_tensor(inv_scale, dtype=F64, device=stacked.device)
                stacked = stacked * torch.stack([inv.square(), inv])
            state.collector.add(
                "structure.module_grads", stacked, decode_module_grads, tuple(metas)
            )


def activation_hook(state: StepState, ctx: StructureState, view: ModuleView) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any = None) -> None:
        if not state.due[ACT_TIER] or recomputing():
            return None
        x = first_tensor(args if view.pre else output)
        if x is None or x.dim() < 2:
            return None
        x = x.detach()
        sq = x.float().square().sum(-1)
        valid = ctx.valid(tuple(x.shape[:-1]))
        ok = valid if valid is not None else torch.ones_like(sq, dtype=torch.bool)
        vec = torch.stack(
            [torch.where(ok, sq, 0).sum(dtype=F64), ok.sum(dtype=F64) * float(x.shape[-1])]
        )
        state.collector.add(
            "structure.module_acts", vec, decode_module_acts, (view.layer, view.role)
        )
        return None

    return hook
