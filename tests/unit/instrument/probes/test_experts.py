"""Expert probes against NumPy: counts over valid tokens, top-k margins, bias sums; the
balance the stream forms from the counts (``stream.derive.expert_balance``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from probe_helpers import f64, gen, padding_mask, ref_block

from probewire.instrument.probes.experts import (
    expert_bias_abs_sum,
    expert_token_counts,
    topk_margin,
)
from probewire.instrument.probes.tokens import token_quantiles
from probewire.stream.derive import expert_balance


def test_expert_counts_exclude_padding_and_match_numpy() -> None:
    t, k, e = 96, 2, 8
    idx = torch.randint(0, e, (t, k), generator=gen(11))
    valid = padding_mask(t, 16)
    idx[~valid] = -1  # padding may carry any index
    counts = expert_token_counts(idx, valid, e)
    want = np.bincount(idx[valid].numpy().ravel(), minlength=e)
    np.testing.assert_array_equal(counts.numpy(), want)
    load = expert_balance(counts.tolist())
    p = want / want.sum()
    assert load is not None and load.total_tokens == k * 80
    np.testing.assert_allclose(load.imbalance, want.max() / want.mean())
    np.testing.assert_allclose(load.max_violation, want.max() / want.mean() - 1)
    np.testing.assert_allclose(load.entropy_norm, -(p[p > 0] * np.log(p[p > 0])).sum() / np.log(e))
    assert load.dead_ratio == np.mean(want == 0)


def test_expert_layer_without_valid_tokens_is_no_measurement() -> None:
    idx = torch.randint(0, 4, (10, 2), generator=gen(12))
    counts = expert_token_counts(idx, torch.zeros(10, dtype=torch.bool), 4)
    assert counts.tolist() == [0, 0, 0, 0]
    assert expert_balance(counts.tolist()) is None


@pytest.mark.parametrize("k", [1, 2])
def test_topk_margin_matches_numpy(k: int) -> None:
    scores = torch.randn(50, 6, generator=gen(13)).softmax(-1)
    ordered = -np.sort(-f64(scores.float()), axis=1)
    margin = topk_margin(scores, k)
    gap = ordered[:, k - 1] - ordered[:, k]
    np.testing.assert_allclose(margin.double().numpy(), gap, atol=1e-7)
    valid = padding_mask(50, 5)
    want = ref_block(gap, f64(valid).astype(bool))[0]
    np.testing.assert_allclose(token_quantiles(margin, valid).numpy(), want, atol=1e-6)


def test_expert_bias_abs_sum() -> None:
    bias = torch.randn(16, generator=gen(14)).bfloat16()
    assert expert_bias_abs_sum(bias).item() == np.abs(f64(bias)).sum()
