"""The loss probe's device components and decoder against float64 NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from probe_helpers import host

from probewire.instrument.probes.loss import loss_components, loss_decoder

LABELS = ((("source", "web"),), (("source", "code"),), (("source", "image"),))


def decode_loss(*calls):
    parts = [(host(t), meta) for t, meta in calls]
    return {(p.name, p.labels): p.value for p in loss_decoder(LABELS)(parts)}


def padded_batch(rng: np.random.Generator, rows: int, seq: int, min_len: int = 0):
    lengths = rng.integers(min_len, seq + 1, size=rows)
    mask = np.arange(seq)[None, :] < lengths[:, None]
    losses = rng.gamma(2.0, 1.5, size=(rows, seq)).astype(np.float32)
    return losses, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_sums_and_counts_exclude_padding_per_row_source(seed):
    rng = np.random.default_rng(seed)
    calls, ref_sum, ref_n = [], 0.0, 0
    ref_src = np.zeros((3, 2))
    for rows in (3, 5):  # uneven micro-batches
        losses, mask = padded_batch(rng, rows, 16)
        losses[~mask] = np.nan  # a NaN at a padded position must not leak in
        src = rng.integers(0, 2, size=rows)
        vec, meta = loss_components(
            torch.from_numpy(losses),
            torch.from_numpy(mask),
            [(torch.from_numpy(src), 0), (None, 2)],
            3,
        )
        calls.append((vec, meta))
        l64 = np.where(mask, losses.astype(np.float64), 0.0)
        ref_sum += l64.sum()
        ref_n += mask.sum()
        for r in range(rows):
            ref_src[src[r]] += (l64[r].sum(), mask[r].sum())
    got = decode_loss(*calls)
    assert got[("loss.sum", ())] == pytest.approx(ref_sum, rel=1e-12)
    assert got[("loss.tokens", ())] == ref_n
    for i, (name,) in enumerate(LABELS[:2]):
        if ref_src[i, 1]:
            assert got[("loss.sum", (name,))] == pytest.approx(ref_src[i, 0], rel=1e-12)
            assert got[("loss.tokens", (name,))] == ref_src[i, 1]
    assert ("loss.sum", LABELS[2]) not in got  # a label without tokens sends nothing


def test_loss_token_level_modality_ids_offset_after_sources():
    rng = np.random.default_rng(3)
    losses, mask = padded_batch(rng, 4, 8, min_len=2)
    modality = rng.integers(0, 2, size=(4, 8))  # per token: 0 -> "code", 1 -> "image"
    vec, meta = loss_components(
        torch.from_numpy(losses),
        torch.from_numpy(mask),
        [(None, 0), (torch.from_numpy(modality), 1)],
        3,
    )
    got = decode_loss((vec, meta))
    l64 = np.where(mask, losses.astype(np.float64), 0.0)
    for m, labels in ((0, LABELS[1]), (1, LABELS[2])):
        sel = mask & (modality == m)
        assert got[("loss.sum", labels)] == pytest.approx(l64[sel].sum(), rel=1e-12)
        assert got[("loss.tokens", labels)] == sel.sum()


def test_a_rank_without_valid_tokens_sends_no_loss_measurement():
    losses = torch.rand(2, 6)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    vec, meta = loss_components(losses, mask, [(torch.tensor([0, 1]), 0)], 3)
    assert decode_loss((vec, meta)) == {}


def test_nan_loss_on_a_valid_token_is_a_non_finite_measurement():
    losses = torch.tensor([[1.0, float("nan"), 2.0]])
    vec, meta = loss_components(losses, torch.tensor([[True, True, False]]), [], 3)
    got = decode_loss((vec, meta))
    assert math.isnan(got[("loss.sum", ())]) and got[("loss.tokens", ())] == 2


def test_loss_without_mask_counts_every_position():
    losses = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    vec, meta = loss_components(losses, None, [], 0)
    got = decode_loss((vec, meta))
    assert got == {("loss.sum", ()): 66.0, ("loss.tokens", ()): 12.0}
