"""Modality probes against NumPy: media scale components across ranks, S_enc's parts."""

from __future__ import annotations

import math

import numpy as np
import torch
from probe_helpers import f64, gen, padding_mask

from probewire.instrument.catalog import Modality
from probewire.instrument.probes.modality import (
    decode_media_scale,
    decode_tokens,
    encoder_grad_share_components,
    media_scale_components,
)

EPS = 1e-12


def decoded(*parts) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in decode_media_scale(list(parts)):
        out[p.name] = out.get(p.name, 0.0) + p.value
    return out


def test_media_scale_across_a_rank_without_media() -> None:
    media = 2.5 * torch.randn(2, 9, 16, generator=gen(19))
    text_a, text_b = torch.randn(30, 16, generator=gen(20)), torch.randn(25, 16, generator=gen(21))
    valid_a, valid_b = padding_mask(30, 4), padding_mask(25, 10)
    text_a[~valid_a] = 1e6  # padding must not count
    rank_a = media_scale_components(media, text_a, text_valid=valid_a).numpy()
    rank_b = media_scale_components(None, text_b, text_valid=valid_b).numpy()
    alone = decoded((rank_b[:2], "media"), (rank_b[2:], "text"))
    assert Modality.MEDIA_N not in alone and alone[Modality.TEXT_N] > 0  # no media: not a 0
    a, b = (decoded((r[:2], "media"), (r[2:], "text")) for r in (rank_a, rank_b))
    summed = {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b.keys()}
    gamma = math.sqrt(summed[Modality.MEDIA_SUM_SQ] / summed[Modality.MEDIA_N]) / (
        math.sqrt(summed[Modality.TEXT_SUM_SQ] / summed[Modality.TEXT_N]) + EPS
    )
    text = np.concatenate([f64(text_a)[:26], f64(text_b)[:15]])
    want_gamma = np.sqrt(np.mean(f64(media) ** 2)) / (np.sqrt(np.mean(text**2)) + EPS)
    np.testing.assert_allclose(gamma, want_gamma, rtol=1e-6)
    assert summed[Modality.TEXT_N] == text.size


def test_modality_token_counts_add_up_per_modality_and_skip_a_zero() -> None:
    points = decode_tokens(
        [(np.array([5.0]), "text"), (np.array([3.0]), "text"), (np.array([0.0]), "media")]
    )
    assert [(p.name, p.labels, p.value) for p in points] == [
        (Modality.TOKENS, (("modality", "text"),), 8.0)
    ]


def test_encoder_grad_share() -> None:
    enc = [torch.randn(30, 4, generator=gen(23)).bfloat16(), None]
    rest = [torch.randn(100, generator=gen(24)), torch.randn(7, 7, generator=gen(25))]
    vec = encoder_grad_share_components(enc, rest)
    enc_sq = sum((f64(g) ** 2).sum() for g in enc if g is not None)
    total = enc_sq + sum((f64(g) ** 2).sum() for g in rest)
    np.testing.assert_allclose(vec.numpy(), [enc_sq, total], rtol=1e-6)
    np.testing.assert_allclose(vec[0] / vec[1], enc_sq / total, rtol=1e-6)
    assert encoder_grad_share_components([], [torch.zeros(3)]).tolist() == [0.0, 0.0]
