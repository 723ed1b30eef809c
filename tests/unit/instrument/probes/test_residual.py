"""Residual-path statistics against independent float64 NumPy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from probe_helpers import f64, gen, padding_mask, ref_block

from probewire.instrument.catalog import Residual
from probewire.instrument.probes.residual import (
    ResidualStat,
    decode_residual,
    gate_saturation,
    residual_token_values,
)
from probewire.instrument.probes.tokens import TokenField, token_quantiles

EPS = 1e-12
THRESHOLDS = (0.05, 0.1, 0.25)


def ref_bf16(v: np.ndarray) -> np.ndarray:
    """Round float64 to bfloat16 (8 significant bits, ties to even) with NumPy only."""
    mantissa, exponent = np.frexp(v)
    return np.ldexp(np.rint(mantissa * 256.0), exponent - 8)


def ref_residual(s: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = s + b
    n_s, n_b, n_a = (np.linalg.norm(t, axis=1) for t in (s, b, a))
    cos = (s * a).sum(1) / (n_s * n_a + EPS)
    noop = ((ref_bf16(a) == ref_bf16(s)) & (b != 0)).mean(1)
    angle = np.arccos(np.clip(cos, -1, 1)) / np.pi
    return np.stack([n_s, n_b, n_b / (n_s + EPS), 1 - cos, angle, noop], axis=1)


def residual_blocks(s, b, valid, **kwargs) -> torch.Tensor:
    return token_quantiles(residual_token_values(s, b, **kwargs), valid.reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_residual_stats_match_numpy_with_padding_excluded(dtype: torch.dtype) -> None:
    t, d, pad = 300, 64, 37
    s = (torch.randn(t, d, generator=gen(2)) * 4).to(dtype)
    b = (torch.randn(t, d, generator=gen(3)) * torch.rand(t, 1, generator=gen(4))).to(dtype)
    s[t - pad :], b[t - pad :] = 1e4, float("nan")  # padding rows hold garbage
    valid = padding_mask(t, pad)
    got = residual_blocks(s, b, valid, chunk_elems=1000).numpy()
    want = ref_block(ref_residual(f64(s), f64(b)), f64(valid).astype(bool))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    decoded = {
        p.name: p.value
        for p in decode_residual([(residual_blocks(s, b, valid).numpy().reshape(-1), (0, "attn"))])
    }
    assert decoded[Residual.TOKENS] == t - pad
    want_mean = want[ResidualStat.BRANCH_RATIO, TokenField.SUM] / (t - pad)
    np.testing.assert_allclose(
        decoded[Residual.name("ratio", "sum")] / (t - pad), want_mean, rtol=2e-5
    )


def test_block_importance_keeps_relative_accuracy_for_tiny_branches() -> None:
    """B ≈ 5e-9 here; 1 − cos in float32 would be off by more than 10×."""
    s = torch.randn(64, 256, generator=gen(5))
    b = 1e-4 * torch.randn(64, 256, generator=gen(6))
    got = residual_token_values(s, b).double().numpy()
    want = ref_residual(f64(s), f64(b))
    np.testing.assert_allclose(got[:, ResidualStat.BLOCK_IMPORTANCE], want[:, 3], rtol=1e-3)
    np.testing.assert_allclose(got[:, ResidualStat.ANGLE], want[:, 4], rtol=1e-3)


def test_token_outlier_shows_per_token_but_hides_when_flattened() -> None:
    """Three tokens whose branch overwrites a tiny stream: R_b ≈ 17 there, 0.01 elsewhere."""
    t, d = 200, 32
    s = 10 * torch.randn(t, d, generator=gen(7))
    s[-3:] *= 1e-3
    direction = torch.nn.functional.normalize(torch.randn(t, d, generator=gen(26)), dim=1)
    b = 0.01 * s.norm(dim=1, keepdim=True) * direction
    b[-3:] = torch.nn.functional.normalize(torch.randn(3, d, generator=gen(27)), dim=1)
    block = residual_blocks(s, b, torch.ones(t, dtype=torch.bool))[ResidualStat.BRANCH_RATIO]
    flattened = float(np.linalg.norm(f64(b)) / np.linalg.norm(f64(s)))
    assert flattened < 0.02
    assert block[TokenField.P99] > 5 and block[TokenField.MAX] > 5
    assert block[TokenField.P99] > 100 * flattened


def test_bf16_noop_fraction_on_known_values() -> None:
    rows = [
        ([256.0] * 4, [0.5] * 4, 1.0),  # 256.5 rounds back to 256: swallowed
        ([1.0] * 4, [0.5] * 4, 0.0),  # 1.5 is representable
        ([256.0] * 4, [0.0] * 4, 0.0),  # b = 0 is not an update
        ([256.0] * 4, [1.0] * 4, 1.0),  # 257 ties to even 256
        ([258.0] * 4, [1.0] * 4, 0.0),  # 259 ties to even 260
        ([256.0, 1.0, 256.0, 1.0], [0.5] * 4, 0.5),
    ]
    s = torch.tensor([r[0] for r in rows], dtype=torch.bfloat16)
    b = torch.tensor([r[1] for r in rows], dtype=torch.bfloat16)
    got = residual_token_values(s, b)[:, ResidualStat.NOOP_FRAC]
    assert got.tolist() == [r[2] for r in rows]
    np.testing.assert_array_equal(got.numpy(), ref_residual(f64(s), f64(b))[:, 5])


def test_bf16_noop_fraction_matches_numpy_rounding() -> None:
    s = (torch.randn(128, 96, generator=gen(8)) * 300).to(torch.bfloat16)
    b = (torch.randn(128, 96, generator=gen(9)) * 0.8).to(torch.bfloat16)
    got = residual_token_values(s, b)[:, ResidualStat.NOOP_FRAC].double().numpy()
    want = ref_residual(f64(s), f64(b))[:, 5]
    assert 0.05 < want.mean() < 0.95
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_gate_saturation_at_three_thresholds() -> None:
    beta = torch.tensor([0.01, 0.07, 0.2, 0.3, 0.6, 0.9, 0.04, 0.12], dtype=torch.float64)
    gate = (2.0 * torch.logit(beta)).float()  # temperature 2
    blocks = gate_saturation(gate, temperature=2.0, thresholds=THRESHOLDS)
    np.testing.assert_allclose(blocks[:, TokenField.SUM].numpy(), [2 / 8, 3 / 8, 5 / 8])
    assert blocks[2, TokenField.COUNT] == 1 and blocks[2, TokenField.MAX] == 5 / 8


def test_per_token_gate_saturation_matches_numpy() -> None:
    gate = 3 * torch.randn(120, 40, generator=gen(10))
    valid = padding_mask(120, 20)
    got = gate_saturation(gate, valid, temperature=1.5, thresholds=THRESHOLDS).numpy()
    sig = 1 / (1 + np.exp(-f64(gate) / 1.5))
    fracs = np.stack([(sig < theta).mean(1) for theta in THRESHOLDS], axis=1)
    np.testing.assert_allclose(got, ref_block(fracs, f64(valid).astype(bool)), rtol=1e-7)
