"""Modality probes (seeds 001 §9): tokens per modality entering the backbone on every step;
the media scale components (Σe² and elements of media and valid text embeddings) and the
encoder's gradient share components on scan steps. Registered for models with a media
projector.

The stream forms π^(μ) from the token counts and γ = RMS(media)/(RMS(text) + ε) from the
components summed over ranks (token-weighted, never averaged per sample or rank). A rank
that received no media sends no media measurement, never a zero.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..catalog import Label, Modality, tier_of
from ..parallel import local
from ..scan import ScanFields, scan
from ..state import StepState
from ..wire import Point
from .common import F64, first_tensor, labels_of, recomputing
from .layout import StructureState

__all__ = [
    "decode_encoder_grad",
    "decode_media_scale",
    "decode_tokens",
    "encoder_grad_share_components",
    "media_scale_components",
]

TOKENS_TIER = tier_of(Modality.TOKENS)
SCALE_TIER = tier_of(Modality.MEDIA_SUM_SQ, Modality.MEDIA_N, Modality.TEXT_SUM_SQ, Modality.TEXT_N)
ENCODER_TIER = tier_of(
    Modality.ENCODER_GRAD_SQ, Modality.ALL_GRAD_SQ, Modality.ENCODER_PARAMS, Modality.ALL_PARAMS
)
Parts = list[tuple[np.ndarray, Any]]


# ------------------------------------------------------------------ device arithmetic
def media_scale_components(
    media: torch.Tensor | None,
    text: torch.Tensor,
    *,
    media_valid: torch.Tensor | None = None,
    text_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """[Σe² media, media elements, Σe² text, text elements], float64 [4] (seeds §9, γ).

    Measurement point: the backbone's input — ``media`` [..., d] from the encoder and
    projector, ``text`` [..., d] from the token embedding — with optional token masks
    [...] that drop padding and placeholders. Non-finite elements are neither summed nor
    counted. A rank without media passes ``media=None``: its media count is 0, which the
    host reads as "no media measurement".
    """
    if media is None:
        media_part = torch.zeros(2, dtype=F64, device=text.device)
    else:
        media_part = _masked_square_sum(media, media_valid)
    return torch.cat([media_part, _masked_square_sum(text, text_valid)])


def _masked_square_sum(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    x = x.detach()
    if valid is None:
        elements = torch.full((), float(x.numel()), dtype=F64, device=x.device)
    else:
        x = torch.where(valid.unsqueeze(-1), x, 0)
        elements = valid.sum().to(F64) * x.shape[-1]
    scanned = scan(x)
    return torch.stack([scanned[ScanFields.SUM_SQ], elements - scanned[ScanFields.NONFINITE]])


def encoder_grad_share_components(
    encoder_grads: Iterable[torch.Tensor | None], other_grads: Iterable[torch.Tensor | None]
) -> torch.Tensor:
    """[‖g_enc‖², ‖g‖²] float64 [2] for S_enc = ‖g_enc‖²/‖g‖² (§9, P1).

    Measurement point: parameter gradients after accumulation and loss-scale removal,
    before clipping. Pass the encoder's gradients and every other gradient, each once
    (``None`` adds nothing). Squares come from ``scan``, so non-finite elements are left
    out (the gradient-norm probe reports them). Shards add across ranks.
    """
    sums = []
    for grads in (encoder_grads, other_grads):
        parts = [scan(g)[ScanFields.SUM_SQ] for g in grads if g is not None]
        sums.append(torch.stack(parts).sum() if parts else None)
    device = next((s.device for s in sums if s is not None), torch.device("cpu"))
    zero = torch.zeros((), dtype=F64, device=device)
    enc, rest = (s if s is not None else zero for s in sums)
    return torch.stack([enc, enc + rest])


# ------------------------------------------------------------------ host decoding
_SCALE_NAMES = {
    "media": (Modality.MEDIA_SUM_SQ, Modality.MEDIA_N),
    "text": (Modality.TEXT_SUM_SQ, Modality.TEXT_N),
}


def decode_tokens(parts: Parts) -> list[Point]:
    totals: dict[str, float] = {}
    for values, modality in parts:
        totals[modality] = totals.get(modality, 0.0) + float(values[0])
    return [
        Point(Modality.TOKENS, v, labels_of((Label.MODALITY, k)))
        for k, v in sorted(totals.items())
        if v > 0
    ]


def decode_media_scale(parts: Parts) -> list[Point]:
    totals = {"media": [0.0, 0.0], "text": [0.0, 0.0]}
    for values, modality in parts:
        totals[modality][0] += float(values[0])
        totals[modality][1] += float(values[1])
    out = []
    for modality, (sum_sq, n) in totals.items():
        if n > 0:  # a rank that received no media has no media measurement
            sum_name, n_name = _SCALE_NAMES[modality]
            out += [Point(sum_name, sum_sq), Point(n_name, n)]
    return out


def decode_encoder_grad(parts: Parts) -> list[Point]:
    values, (enc_params, all_params) = parts[0]
    enc, total = values.tolist()
    return [
        Point(Modality.ENCODER_GRAD_SQ, enc),
        Point(Modality.ALL_GRAD_SQ, total),
        Point(Modality.ENCODER_PARAMS, enc_params),
        Point(Modality.ALL_PARAMS, all_params),
    ]


# ------------------------------------------------------------------ hooks
def embedding_hook(state: StepState, ctx: StructureState):
    """The token embedding's output: text tokens, and the text side of γ."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not (state.due[TOKENS_TIER] or state.due[SCALE_TIER]) or recomputing():
            return None
        e = first_tensor(output)
        if e is None or e.dim() < 2:
            return None
        text = ctx.text
        valid = text if text is not None and tuple(text.shape) == tuple(e.shape[:-1]) else None
        if state.due[TOKENS_TIER]:
            count = (
                valid.sum()
                if valid is not None
                else torch.tensor(float(math.prod(e.shape[:-1])), device=e.device)
            )
            state.collector.add(
                "structure.modality_tokens", count.reshape(1), decode_tokens, "text"
            )
        if state.due[SCALE_TIER]:
            parts = media_scale_components(None, e, text_valid=valid)[2:]
            state.collector.add("structure.media_scale", parts, decode_media_scale, "text")
        return None

    return hook


def projector_hook(state: StepState, ctx: StructureState):
    """The media projector's output: media tokens, the media side of γ, and the media
    mask the other structure probes lay activations out with."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not (state.due[TOKENS_TIER] or state.due[SCALE_TIER]) or recomputing():
            return None
        e = first_tensor(output)
        if e is None or e.dim() < 2:
            return None
        mask = args[1] if len(args) > 1 else kwargs.get("token_mask", kwargs.get("mask"))
        lead = tuple(e.shape[:-1])
        if not (
            isinstance(mask, torch.Tensor)
            and mask.dtype == torch.bool
            and tuple(mask.shape) == lead
        ):
            mask = torch.ones(lead, dtype=torch.bool, device=e.device)
        ctx.set_media(mask)
        if state.due[TOKENS_TIER]:
            state.collector.add(
                "structure.modality_tokens", mask.sum().reshape(1), decode_tokens, "media"
            )
        if state.due[SCALE_TIER]:
            parts = media_scale_components(e, e[..., :0, :], media_valid=mask)[:2]
            state.collector.add("structure.media_scale", parts, decode_media_scale, "media")
        return None

    return hook


class EncoderShare:
    """S_enc's components at the gradient point: the encoder's own gradients against every
    gradient this rank counts (inv_scale removes a loss scale)."""

    def __init__(self, encoder: list[nn.Parameter], others: list[nn.Parameter]) -> None:
        self._encoder, self._others = encoder, others
        enc = float(sum(p.numel() for p in encoder))
        self._counts = (enc, enc + float(sum(p.numel() for p in others)))

    def record(self, state: StepState, inv_scale: Any) -> None:
        if not self._encoder or not state.due[ENCODER_TIER]:
            return
        vec = encoder_grad_share_components(
            [None if p.grad is None else local(p.grad) for p in self._encoder],
            [None if p.grad is None else local(p.grad) for p in self._others],
        )
        if inv_scale is not None:
            vec = vec * torch.as_tensor(inv_scale, dtype=F64, device=vec.device).square()
        state.collector.add("structure.encoder_grad", vec, decode_encoder_grad, self._counts)
