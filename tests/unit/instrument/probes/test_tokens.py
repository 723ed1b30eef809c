"""Token blocks (count, sum, p90, p99, max over valid tokens) against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from probe_helpers import f64, gen, ref_block

from probewire.instrument.probes.tokens import TokenField, token_quantiles


@pytest.mark.parametrize("columns", [None, 3])
def test_token_quantiles_match_numpy(columns: int | None) -> None:
    shape = (257,) if columns is None else (257, columns)
    values = torch.randn(shape, generator=gen(0), dtype=torch.float64).exp()
    valid = torch.rand(257, generator=gen(1)) > 0.3
    values[~valid] = float("nan")  # garbage in excluded tokens must not matter
    got = token_quantiles(values, valid).numpy()
    want = ref_block(f64(values), f64(valid).astype(bool))
    np.testing.assert_allclose(got, want[0] if columns is None else want, rtol=1e-12)


def test_token_quantiles_without_valid_tokens_is_no_measurement() -> None:
    block = token_quantiles(torch.randn(5), torch.zeros(5, dtype=torch.bool))
    assert block[TokenField.COUNT] == 0
    empty = token_quantiles(torch.empty(0), torch.empty(0, dtype=torch.bool))
    assert empty[TokenField.COUNT] == 0
