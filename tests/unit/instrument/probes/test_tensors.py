"""The tensor probe's masked scan, loss-scale removal and AdamW chain against float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probewire.instrument.probes.tensors import adamw_chain, masked_scan, scale_scan
from probewire.instrument.scan import ScanFields as F


def scan_reference(a: np.ndarray) -> np.ndarray:
    f = a[np.isfinite(a)]
    return np.array(
        [
            a.size,
            f.sum(),
            (f * f).sum(),
            np.abs(f).sum(),
            np.abs(f).max() if f.size else 0.0,
            np.count_nonzero(a == 0),
            np.count_nonzero(~np.isfinite(a)),
        ]
    )


@pytest.mark.parametrize("chunk", [None, 1000])  # 1000: the tensor spans many chunks
def test_masked_scan_covers_valid_positions_only(chunk):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(3, 40, 17)).astype(np.float32)
    x[0, 0, :4] = 0.0
    x[1, 2, 5] = np.inf
    mask = rng.random((3, 40)) > 0.3
    mask[1, 2] = True
    x[~mask] = np.nan  # padded garbage is neither counted nor non-finite
    vec = masked_scan(
        torch.from_numpy(x), torch.from_numpy(mask), None, moments=False, chunk_elems=chunk
    ).numpy()
    ref = scan_reference(x[mask].astype(np.float64))
    for field in (F.N, F.ZEROS, F.NONFINITE, F.ABS_MAX):
        assert vec[field] == ref[field], field.name
    for field in (F.SUM, F.SUM_SQ, F.SUM_ABS):
        assert vec[field] == pytest.approx(ref[field], rel=1e-5, abs=1e-3), field.name


def test_masked_scan_of_a_zero_tensor_and_an_unmatched_shape():
    zeros = torch.zeros(2, 4, 3)
    vec = masked_scan(
        zeros,
        torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool),
        None,
        moments=False,
        chunk_elems=None,
    )
    assert vec[F.N] == 9 and vec[F.ZEROS] == 9 and vec[F.SUM_SQ] == 0
    whole = masked_scan(
        torch.ones(5), torch.ones(2, 4, dtype=torch.bool), None, moments=False, chunk_elems=None
    )
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
    for _ in range(1, 4):
        w.grad = torch.randn(50)
        opt.step()
        g = w.grad.double()
        m, v = 0.8 * m + 0.2 * g, 0.9 * v + 0.1 * g * g
    denom = (v / (1 - 0.9**3)).sqrt() + 1e-6
    normalized, direction = adamw_chain(w, w.grad, opt.state[w], opt.param_groups[0])
    assert torch.allclose(normalized.double(), g / denom, rtol=1e-5)
    assert torch.allclose(direction.double(), (m / (1 - 0.8**3)) / denom, rtol=1e-5)
