"""Structure statistics against independent float64 NumPy references on the same inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probewire.instrument import structure as st
from probewire.instrument.structure import LogitsField, MediaField, ResidualStat, TokenField

EPS = 1e-12


def f64(x: torch.Tensor) -> np.ndarray:
    """Exact float64 values of ``x`` (torch converts; bf16 has no NumPy dtype)."""
    return x.detach().to(torch.float64).numpy()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def padding_mask(t: int, n_pad: int) -> torch.Tensor:
    valid = torch.ones(t, dtype=torch.bool)
    valid[t - n_pad :] = False
    return valid


def ref_block(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[C, 5] token blocks: count, sum, p90, p99, max over the valid rows."""
    v = values.reshape(values.shape[0], -1)[valid]
    return np.stack(
        [
            np.full(v.shape[1], v.shape[0]),
            v.sum(0),
            np.quantile(v, 0.90, axis=0),
            np.quantile(v, 0.99, axis=0),
            v.max(0),
        ],
        axis=-1,
    )


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


# ------------------------------------------------------------------------ token quantiles


@pytest.mark.parametrize("columns", [None, 3])
def test_token_quantiles_match_numpy(columns: int | None) -> None:
    shape = (257,) if columns is None else (257, columns)
    values = torch.randn(shape, generator=gen(0), dtype=torch.float64).exp()
    valid = torch.rand(257, generator=gen(1)) > 0.3
    values[~valid] = float("nan")  # garbage in excluded tokens must not matter
    got = st.token_quantiles(values, valid).numpy()
    want = ref_block(f64(values), f64(valid).astype(bool))
    np.testing.assert_allclose(got, want[0] if columns is None else want, rtol=1e-12)


def test_token_quantiles_without_valid_tokens_is_no_measurement() -> None:
    block = st.token_quantiles(torch.randn(5), torch.zeros(5, dtype=torch.bool))
    assert block[TokenField.COUNT] == 0 and st.summarize_tokens(block) is None
    empty = st.token_quantiles(torch.empty(0), torch.empty(0, dtype=torch.bool))
    assert st.summarize_tokens(empty) is None


# ------------------------------------------------------------------------- residual paths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_residual_stats_match_numpy_with_padding_excluded(dtype: torch.dtype) -> None:
    t, d, pad = 300, 64, 37
    s = (torch.randn(t, d, generator=gen(2)) * 4).to(dtype)
    b = (torch.randn(t, d, generator=gen(3)) * torch.rand(t, 1, generator=gen(4))).to(dtype)
    s[t - pad :], b[t - pad :] = 1e4, float("nan")  # padding rows hold garbage
    valid = padding_mask(t, pad)
    got = st.residual_stats(s, b, valid, chunk_elems=1000).numpy()
    want = ref_block(ref_residual(f64(s), f64(b)), f64(valid).astype(bool))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)
    summary = st.summarize_residual(st.residual_stats(s, b, valid))
    assert summary is not None and summary.branch_ratio.count == t - pad
    want_mean = want[ResidualStat.BRANCH_RATIO, TokenField.SUM] / (t - pad)
    np.testing.assert_allclose(summary.branch_ratio.mean, want_mean, rtol=2e-5)


def test_block_importance_keeps_relative_accuracy_for_tiny_branches() -> None:
    """B ≈ 5e-9 here; 1 − cos in float32 would be off by more than 10×."""
    s = torch.randn(64, 256, generator=gen(5))
    b = 1e-4 * torch.randn(64, 256, generator=gen(6))
    got = st.residual_token_values(s, b).double().numpy()
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
    block = st.residual_stats(s, b, torch.ones(t, dtype=torch.bool))[ResidualStat.BRANCH_RATIO]
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
    got = st.residual_token_values(s, b)[:, ResidualStat.NOOP_FRAC]
    assert got.tolist() == [r[2] for r in rows]
    np.testing.assert_array_equal(got.numpy(), ref_residual(f64(s), f64(b))[:, 5])


def test_bf16_noop_fraction_matches_numpy_rounding() -> None:
    s = (torch.randn(128, 96, generator=gen(8)) * 300).to(torch.bfloat16)
    b = (torch.randn(128, 96, generator=gen(9)) * 0.8).to(torch.bfloat16)
    got = st.residual_token_values(s, b)[:, ResidualStat.NOOP_FRAC].double().numpy()
    want = ref_residual(f64(s), f64(b))[:, 5]
    assert 0.05 < want.mean() < 0.95
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_gate_saturation_at_three_thresholds() -> None:
    beta = torch.tensor([0.01, 0.07, 0.2, 0.3, 0.6, 0.9, 0.04, 0.12], dtype=torch.float64)
    gate = (2.0 * torch.logit(beta)).float()  # temperature 2
    blocks = st.gate_saturation(gate, temperature=2.0)
    np.testing.assert_allclose(blocks[:, TokenField.SUM].numpy(), [2 / 8, 3 / 8, 5 / 8])
    summary = st.summarize_gate_saturation(blocks)
    assert summary is not None and summary[0.25].count == 1 and summary[0.25].max == 5 / 8


def test_per_token_gate_saturation_matches_numpy() -> None:
    gate = 3 * torch.randn(120, 40, generator=gen(10))
    valid = padding_mask(120, 20)
    got = st.gate_saturation(gate, valid, temperature=1.5).numpy()
    sig = 1 / (1 + np.exp(-f64(gate) / 1.5))
    fracs = np.stack([(sig < theta).mean(1) for theta in st.GATE_THRESHOLDS], axis=1)
    np.testing.assert_allclose(got, ref_block(fracs, f64(valid).astype(bool)), rtol=1e-7)


# -------------------------------------------------------------------------------- experts


def test_expert_counts_exclude_padding_and_match_numpy() -> None:
    t, k, e = 96, 2, 8
    idx = torch.randint(0, e, (t, k), generator=gen(11))
    valid = padding_mask(t, 16)
    idx[~valid] = -1  # padding may carry any index
    counts = st.expert_token_counts(idx, valid, e)
    want = np.bincount(idx[valid].numpy().ravel(), minlength=e)
    np.testing.assert_array_equal(counts.numpy(), want)
    load = st.summarize_expert_counts(counts)
    p = want / want.sum()
    assert load is not None and load.tokens == k * 80
    np.testing.assert_allclose(load.imbalance, want.max() / want.mean())
    np.testing.assert_allclose(load.max_violation, want.max() / want.mean() - 1)
    np.testing.assert_allclose(load.entropy_norm, -(p[p > 0] * np.log(p[p > 0])).sum() / np.log(e))
    assert load.dead_fraction == np.mean(want == 0)


def test_expert_layer_without_valid_tokens_is_no_measurement() -> None:
    idx = torch.randint(0, 4, (10, 2), generator=gen(12))
    counts = st.expert_token_counts(idx, torch.zeros(10, dtype=torch.bool), 4)
    assert counts.tolist() == [0, 0, 0, 0]
    assert st.summarize_expert_counts(counts) is None


@pytest.mark.parametrize("k", [1, 2])
def test_topk_margin_matches_numpy(k: int) -> None:
    scores = torch.randn(50, 6, generator=gen(13)).softmax(-1)
    ordered = -np.sort(-f64(scores.float()), axis=1)
    margin = st.topk_margin(scores, k)
    gap = ordered[:, k - 1] - ordered[:, k]
    np.testing.assert_allclose(margin.double().numpy(), gap, atol=1e-7)
    valid = padding_mask(50, 5)
    want = ref_block(gap, f64(valid).astype(bool))[0]
    np.testing.assert_allclose(st.token_quantiles(margin, valid).numpy(), want, atol=1e-6)


def test_expert_bias_abs_sum() -> None:
    bias = torch.randn(16, generator=gen(14)).bfloat16()
    assert st.expert_bias_abs_sum(bias).item() == np.abs(f64(bias)).sum()


# --------------------------------------------------------------------------- output layer


def ref_logits(z: np.ndarray, valid: np.ndarray) -> dict[str, float]:
    rows = z[valid]
    finite = np.isfinite(rows)
    top = -np.sort(-np.where(np.isnan(rows), np.inf, rows), axis=1)[:, :2]
    ok = np.isfinite(top).all(1)
    return {
        "tokens": rows.shape[0],
        "rms": math.sqrt((rows[finite] ** 2).sum() / finite.sum()),
        "abs_max": np.abs(rows[finite]).max(),
        "nonfinite": int((~finite).sum()),
        "gap": (top[ok, 0] - top[ok, 1]).mean(),
        "ties": (top[ok, 0] == top[ok, 1]).mean(),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_stats_match_numpy_including_ties(dtype: torch.dtype) -> None:
    t, v = 40, 50
    z = 3 * torch.randn(t, v, generator=gen(15))
    z[::4, 7] = z[::4, 9] = z[::4].amax(1) + 1.0  # exact top-1 == top-2 ties on every 4th row
    z[5, :10] = -float("inf")  # masked vocabulary on a valid row
    z = z.to(dtype)
    valid = padding_mask(t, 6)
    z[~valid] = float("nan")
    vec = st.logits_stats(z, valid, chunk_elems=200)  # 4 rows per block
    want = ref_logits(f64(z), f64(valid).astype(bool))
    got = st.summarize_logits(vec)
    assert got is not None
    assert (got.tokens, got.nonfinite) == (want["tokens"], want["nonfinite"])
    assert vec[LogitsField.ELEMENTS] == want["tokens"] * v
    np.testing.assert_allclose(got.rms, want["rms"], rtol=1e-6)
    assert got.abs_max == want["abs_max"]
    np.testing.assert_allclose(got.top2_gap_mean, want["gap"], rtol=1e-6)
    assert got.top2_tie_ratio == want["ties"] and got.top2_tie_ratio > 0.2


def test_logits_without_valid_tokens_is_no_measurement() -> None:
    vec = st.logits_stats(torch.randn(4, 8), torch.zeros(4, dtype=torch.bool))
    assert st.summarize_logits(vec) is None


def test_mtp_top1_agreement_on_aligned_targets() -> None:
    batch, seq, vocab, depth = 3, 12, 7, 1
    main = torch.randn(batch, seq, vocab, generator=gen(16))
    mtp = main + 0.8 * torch.randn(batch, seq, vocab, generator=gen(17))
    target_valid = torch.rand(batch, seq, generator=gen(18)) > 0.2
    # main row t predicts token t+1; MTP depth 1 at row t predicts token t+2 = main row t+1
    aligned_main, aligned_mtp = main[:, depth:], mtp[:, : seq - depth]
    valid = target_valid[:, depth:]
    vec = st.mtp_top1_agreement(aligned_main, aligned_mtp, valid)
    m = f64(valid).astype(bool)
    same = f64(aligned_main).argmax(-1) == f64(aligned_mtp).argmax(-1)
    assert vec.tolist() == [m.sum(), (same & m).sum()]
    np.testing.assert_allclose(st.summarize_mtp_agreement(vec), (same & m).sum() / m.sum())
    assert st.summarize_mtp_agreement(torch.zeros(2)) is None


# ------------------------------------------------------------------------------- modality


def test_media_scale_across_a_rank_without_media() -> None:
    media = 2.5 * torch.randn(2, 9, 16, generator=gen(19))
    text_a, text_b = torch.randn(30, 16, generator=gen(20)), torch.randn(25, 16, generator=gen(21))
    valid_a, valid_b = padding_mask(30, 4), padding_mask(25, 10)
    text_a[~valid_a] = 1e6  # padding must not count
    rank_a = st.media_scale_components(media, text_a, text_valid=valid_a)
    rank_b = st.media_scale_components(None, text_b, text_valid=valid_b)
    alone = st.media_scale(rank_b)
    assert alone.media_m2 is None and alone.gamma is None and alone.text_m2 is not None
    both = st.media_scale(rank_a + rank_b)
    text = np.concatenate([f64(text_a)[:26], f64(text_b)[:15]])
    want_gamma = np.sqrt(np.mean(f64(media) ** 2)) / (np.sqrt(np.mean(text**2)) + EPS)
    np.testing.assert_allclose(both.gamma, want_gamma, rtol=1e-6)
    assert (rank_a + rank_b)[MediaField.TEXT_ELEMENTS] == text.size


def test_modality_token_counts_and_shares() -> None:
    ids = torch.randint(0, 3, (64,), generator=gen(22))
    valid = padding_mask(64, 9)
    counts = st.modality_token_counts(ids, valid, 3)
    want = np.bincount(ids.numpy()[f64(valid).astype(bool)], minlength=3)
    np.testing.assert_array_equal(counts.numpy(), want)
    np.testing.assert_allclose(st.token_shares(counts), want / want.sum())
    assert st.token_shares(st.modality_token_counts(ids, torch.zeros(64, dtype=bool), 3)) is None


def test_encoder_grad_share() -> None:
    enc = [torch.randn(30, 4, generator=gen(23)).bfloat16(), None]
    rest = [torch.randn(100, generator=gen(24)), torch.randn(7, 7, generator=gen(25))]
    vec = st.encoder_grad_share_components(enc, rest)
    enc_sq = sum((f64(g) ** 2).sum() for g in enc if g is not None)
    total = enc_sq + sum((f64(g) ** 2).sum() for g in rest)
    np.testing.assert_allclose(vec.numpy(), [enc_sq, total], rtol=1e-6)
    np.testing.assert_allclose(st.encoder_grad_share(vec), enc_sq / total, rtol=1e-6)
    assert st.encoder_grad_share(st.encoder_grad_share_components([], [torch.zeros(3)])) is None


# -------------------------------------------------------------------------- host sync


def test_device_side_functions_read_no_data_on_the_host() -> None:
    """Meta tensors carry no data, so any .item()/.cpu()/mask indexing would raise."""
    m = "meta"
    valid = torch.ones(50, dtype=torch.bool, device=m)
    x, y = torch.empty(50, 16, device=m), torch.empty(50, 16, device=m)
    logits = torch.empty(50, 100, device=m, dtype=torch.bfloat16)
    outputs = [
        st.residual_stats(x, y, valid, chunk_elems=200),
        st.gate_saturation(x, valid),
        st.expert_token_counts(torch.empty(50, 2, dtype=torch.long, device=m), valid, 8),
        st.token_quantiles(st.topk_margin(x, 2), valid),
        st.logits_stats(logits, valid, chunk_elems=1000),
        st.mtp_top1_agreement(logits, logits, valid),
        st.media_scale_components(x[:3], y, text_valid=valid),
        st.modality_token_counts(torch.empty(50, dtype=torch.long, device=m), valid, 3),
        st.encoder_grad_share_components([x], [y]),
    ]
    assert all(out.device.type == "meta" for out in outputs)
