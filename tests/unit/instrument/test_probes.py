"""Device-side probe arithmetic plus its host decoders, against float64 NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probewire.instrument.probes import (
    HOST_REDUCE_POSITIONS,
    adamw_chain,
    grad_norms,
    loss_components,
    masked_scan,
    output_head,
    output_top2,
    scale_scan,
)
from probewire.instrument.scan import ScanFields as F
from probewire.instrument.steps import decode_head, decode_norms, decode_top2, loss_decoder

LABELS = ((("source", "web"),), (("source", "code"),), (("source", "image"),))


def host(tensors) -> np.ndarray:
    """What the step's one ``cat`` makes of a part: flattened, promoted to float64."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).numpy()


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
        vec, meta = loss_components(torch.from_numpy(losses), torch.from_numpy(mask),
                                    [(torch.from_numpy(src), 0), (None, 2)], 3)
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
    vec, meta = loss_components(torch.from_numpy(losses), torch.from_numpy(mask),
                                [(None, 0), (torch.from_numpy(modality), 1)], 3)
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


def test_grad_norm_reproduces_clip_grad_norm_and_float64_reference():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((7, 5), (300,), (3, 3, 3))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    vec = grad_norms([p.grad for p in params], None)
    [point] = decode_norms([(host(vec), None)])
    ref = sum(float((p.grad.double() ** 2).sum()) for p in params)
    clip = float(torch.nn.utils.clip_grad_norm_(params, 1e9))
    assert point.value == pytest.approx(ref, rel=1e-6)
    assert math.sqrt(point.value) == pytest.approx(clip, rel=1e-12)


def test_grad_norm_removes_the_loss_scale_and_derives_the_clip_indicator():
    g = [torch.full((10,), 2.0), torch.full((6,), -1.0)]
    vec = grad_norms([t * 1024.0 for t in g], torch.tensor(1 / 1024.0, dtype=torch.float64))
    points = {p.name: p.value for p in decode_norms([(host(vec), 5.0)])}
    assert points["grad.norm_sq"] == pytest.approx(46.0, rel=1e-6)  # float32 norms
    assert points["grad.clipped"] == 1.0  # sqrt(46) > 5
    points = {p.name: p.value for p in decode_norms([(host(vec), 7.0)])}
    assert points["grad.clipped"] == 0.0


def test_grad_norm_with_an_inf_element_is_non_finite():
    vec = grad_norms([torch.tensor([1.0, float("inf")]), torch.ones(3)], None)
    [point] = decode_norms([(host(vec), None)])
    assert point.value == math.inf


def head_reference(z: np.ndarray, mask: np.ndarray | None):
    sel = z.reshape(-1, z.shape[-1]) if mask is None else z[mask]
    return np.abs(sel).max(), (sel.astype(np.float64) ** 2).sum(), sel.size


@pytest.mark.parametrize("rows,seq", [(3, 7), (4, HOST_REDUCE_POSITIONS // 2)])  # host, device
def test_output_head_over_valid_positions(rows, seq):
    rng = np.random.default_rng(4)
    z = rng.normal(0, 3, size=(rows, seq, 11)).astype(np.float32)
    mask = rng.random((rows, seq)) > 0.4
    z[~mask] = 1e6  # padded positions must not count
    parts = []
    for half in (slice(0, rows // 2 + 1), slice(rows // 2 + 1, rows)):  # two micro-batches
        vec, meta = output_head(torch.from_numpy(z[half]), torch.from_numpy(mask[half]))
        parts.append((host(vec), meta))
    got = {p.name: p.value for p in decode_head(parts)}
    abs_max, sum_sq, n = head_reference(z, mask)
    assert got["output.logits_abs_max"] == pytest.approx(abs_max, rel=1e-7)
    assert got["output.logits_sum_sq"] == pytest.approx(sum_sq, rel=1e-5)
    assert got["output.logits_n"] == n


def test_output_head_without_mask_and_with_a_nan_logit():
    z = torch.randn(2, 5, 6)
    vec, meta = output_head(z, None)
    got = {p.name: p.value for p in decode_head([(host(vec), meta)])}
    assert got["output.logits_abs_max"] == pytest.approx(float(z.abs().max()), rel=1e-7)
    assert got["output.logits_n"] == 60
    z[1, 2, 3] = float("nan")
    vec, meta = output_head(z, torch.ones(2, 5, dtype=torch.bool))
    got = {p.name: p.value for p in decode_head([(host(vec), meta)])}
    assert math.isnan(got["output.logits_abs_max"]) and math.isnan(got["output.logits_sum_sq"])


def test_output_head_with_no_valid_position_sends_nothing():
    vec, meta = output_head(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.bool))
    assert decode_head([(host(vec), meta)]) == []


def test_output_top2_gap_and_ties_over_valid_positions():
    z = torch.tensor([[[1.0, 5.0, 3.0], [2.0, 2.0, 0.0], [9.0, 0.0, 0.0]]])
    mask = torch.tensor([[True, True, False]])
    got = {p.name: p.value for p in decode_top2([(host(output_top2(z, mask)), None)])}
    assert got == {"output.positions": 2.0, "output.top2_gap_sum": 2.0, "output.top2_equal": 1.0}


def scan_reference(a: np.ndarray) -> np.ndarray:
    f = a[np.isfinite(a)]
    return np.array([a.size, f.sum(), (f * f).sum(), np.abs(f).sum(),
                     np.abs(f).max() if f.size else 0.0, np.count_nonzero(a == 0),
                     np.count_nonzero(~np.isfinite(a))])


@pytest.mark.parametrize("chunk", [None, 1000])  # 1000: the tensor spans many chunks
def test_masked_scan_covers_valid_positions_only(chunk):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 40, 17)).astype(np.float32)
    x[0, 0, :4] = 0.0
    x[1, 2, 5] = np.inf
    mask = rng.random((3, 40)) > 0.3
    mask[1, 2] = True
    x[~mask] = np.nan  # padded garbage is neither counted nor non-finite
    vec = masked_scan(torch.from_numpy(x), torch.from_numpy(mask), None, moments=False,
                      chunk_elems=chunk).numpy()
    ref = scan_reference(x[mask].astype(np.float64))
    for field in (F.N, F.ZEROS, F.NONFINITE, F.ABS_MAX):
        assert vec[field] == ref[field], field.name
    for field in (F.SUM, F.SUM_SQ, F.SUM_ABS):
        assert vec[field] == pytest.approx(ref[field], rel=1e-5, abs=1e-3), field.name


def test_masked_scan_of_a_zero_tensor_and_an_unmatched_shape():
    zeros = torch.zeros(2, 4, 3)
    vec = masked_scan(zeros, torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool), None,
                      moments=False, chunk_elems=None)
    assert vec[F.N] == 9 and vec[F.ZEROS] == 9 and vec[F.SUM_SQ] == 0
    whole = masked_scan(torch.ones(5), torch.ones(2, 4, dtype=torch.bool), None,
                        moments=False, chunk_elems=None)
    assert whole[F.N] == 5  # not [B, T]-shaped: scanned whole


def test_scale_scan_divides_by_the_loss_scale():
    x = torch.tensor([2.0, -4.0, 0.0, 8.0])
    got = scale_scan(masked_scan(x * 8, None, None, moments=True, chunk_elems=None), 0.125)
    ref = masked_scan(x, None, None, moments=True, chunk_elems=None)
    assert torch.allclose(got, ref, rtol=1e-12)


def test_adamw_chain_matches_a_manual_float64_adamw():
    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.randn(50))
    opt = torch.optim.AdamW([w], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    m = v = torch.zeros(50, dtype=torch.float64)
    for t in range(1, 4):
        w.grad = torch.randn(50)
        opt.step()
        g = w.grad.double()
        m, v = 0.8 * m + 0.2 * g, 0.9 * v + 0.1 * g * g
    denom = (v / (1 - 0.9 ** 3)).sqrt() + 1e-6
    normalized, direction = adamw_chain(w, w.grad, opt.state[w], opt.param_groups[0])
    assert torch.allclose(normalized.double(), g / denom, rtol=1e-5)
    assert torch.allclose(direction.double(), (m / (1 - 0.8 ** 3)) / denom, rtol=1e-5)
