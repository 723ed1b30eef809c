"""The output-layer probe over valid positions against float64 NumPy references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from probe_helpers import host

from probewire.instrument.probes.head import (
    HOST_REDUCE_POSITIONS,
    decode_head,
    decode_top2,
    output_head,
    output_top2,
)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_rms_gap_and_ties_over_valid_positions_match_numpy(dtype):
    t, v = 40, 50
    g = torch.Generator().manual_seed(15)
    z = 3 * torch.randn(1, t, v, generator=g)
    z[0, ::4, 7] = z[0, ::4, 9] = z[0, ::4].amax(1) + 1.0  # exact top-1 == top-2 ties
    z = z.to(dtype)
    valid = torch.ones(1, t, dtype=torch.bool)
    valid[0, t - 6 :] = False
    z[~valid] = float("nan")  # padding holds garbage
    vec, meta = output_head(z, valid)
    head = {p.name: p.value for p in decode_head([(host(vec), meta)])}
    top2 = {p.name: p.value for p in decode_top2([(host(output_top2(z, valid)), None)])}
    rows = z[valid].to(torch.float64).numpy()
    top = -np.sort(-rows, axis=1)[:, :2]
    assert head["output.logits_n"] == rows.size
    np.testing.assert_allclose(
        math.sqrt(head["output.logits_sum_sq"] / head["output.logits_n"]),
        math.sqrt((rows**2).mean()),
        rtol=1e-6,
    )
    assert head["output.logits_abs_max"] == np.abs(rows).max()
    assert top2["output.positions"] == rows.shape[0]
    np.testing.assert_allclose(
        top2["output.top2_gap_sum"] / top2["output.positions"],
        (top[:, 0] - top[:, 1]).mean(),
        rtol=1e-6,
    )
    ties = top2["output.top2_equal"] / top2["output.positions"]
    assert ties == (top[:, 0] == top[:, 1]).mean() and ties > 0.2
