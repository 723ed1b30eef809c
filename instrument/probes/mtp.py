"""The MTP agreement probe (002 act/mtp_{k}_lm_head_top1_agreement): how often the main head
and MTP depth k predict the same token for the same target, on scan steps.

Rows are aligned on the shared target: the main head at position t + k and MTP depth k at
position t both predict token t + k + 1; only valid targets count, and an argmax tie
resolves to the first index in both heads. Read it with the MTP head's own accuracy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..catalog import Label, Output, tier_of
from ..state import StepState
from ..wire import Point
from .common import F64, first_tensor, labels_of, recomputing
from .layout import StructureState

__all__ = ["decode_mtp", "main_logits_hook", "mtp_hook", "mtp_top1_agreement"]

TIER = tier_of(Output.MTP_POSITIONS, Output.MTP_AGREE)


def mtp_top1_agreement(
    main_logits: torch.Tensor, mtp_logits: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """[positions, agreements] float64 [2] over aligned rows (the caller aligns them: per
    sequence of length S pass ``main[..., k:, :]``, ``mtp_k[..., :S-k, :]`` and the
    validity of those shared targets)."""
    if main_logits.shape != mtp_logits.shape:
        raise ValueError(f"logits differ: {tuple(main_logits.shape)} vs {tuple(mtp_logits.shape)}")
    mask = valid.reshape(-1)
    same = main_logits.detach().argmax(-1).reshape(-1) == mtp_logits.detach().argmax(-1).reshape(-1)
    return torch.stack([mask.sum(), (same & mask).sum()]).to(F64)


def decode_mtp(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    totals: dict[int, list[float]] = {}
    for values, depth in parts:
        t = totals.setdefault(depth, [0.0, 0.0])
        t[0] += float(values[0])
        t[1] += float(values[1])
    out = []
    for depth, (positions, agree) in sorted(totals.items()):
        if positions > 0:
            lab = labels_of((Label.DEPTH, depth))
            out += [
                Point(Output.MTP_POSITIONS, positions, lab),
                Point(Output.MTP_AGREE, agree, lab),
            ]
    return out


def main_logits_hook(state: StepState, ctx: StructureState) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not state.due[TIER] or recomputing():
            return None
        z = first_tensor(output)
        if z is not None and z.dim() == 3:
            ctx.main_logits = z.detach()
        return None

    return hook


def mtp_hook(state: StepState, ctx: StructureState, depth: int) -> Callable:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not state.due[TIER] or recomputing():
            return None
        z, main = first_tensor(output), ctx.main_logits
        if z is None or main is None or z.shape != main.shape or z.shape[1] <= depth:
            return None
        length = z.shape[1]
        text = ctx.text
        valid = (
            text[:, depth:]
            if text is not None and tuple(text.shape) == tuple(z.shape[:2])
            else torch.ones(z.shape[0], length - depth, dtype=torch.bool, device=z.device)
        )
        vec = mtp_top1_agreement(main[:, depth:], z.detach()[:, : length - depth], valid)
        state.collector.add("structure.mtp", vec, decode_mtp, depth)
        return None

    return hook
