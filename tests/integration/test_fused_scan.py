"""The compiled one-pass scan gives the eager scan's vector (within float32 accumulation),
on the tensors and edge cases the tensor probes see; and a monitor configured for it
reports the same tensor statistics. Compiles once (10-20 s on a CPU core)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probewire.instrument.probes.tensors import masked_scan
from probewire.instrument.scan import ScanFields as F
from probewire.instrument.scan import fused_scan, scan

pytestmark = pytest.mark.integration


def cases():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1 << 20, generator=g) * 3 + 1
    with_specials = torch.randn(70_001, generator=g)
    with_specials[[3, 11, 500]] = torch.tensor([math.nan, math.inf, -math.inf])
    with_specials[100:140] = 0.0
    return {"big": big, "specials": with_specials, "bf16": big[:65_537].bfloat16(),
            "zeros": torch.zeros(3, 5, 7), "empty": torch.empty(0),
            "strided": torch.randn(64, 300, generator=g).t()}


@pytest.mark.parametrize("name", sorted(cases()))
def test_fused_scan_equals_the_eager_scan(name):
    x = cases()[name]
    got, want = fused_scan(x), scan(x)
    for field in (F.N, F.ZEROS, F.NONFINITE, F.ABS_MAX):
        assert got[field] == want[field], field.name
    for field in (F.SUM, F.SUM_SQ, F.SUM_ABS):
        assert float(got[field]) == pytest.approx(float(want[field]), rel=2e-6, abs=1e-3)


def test_masked_fused_scan_covers_valid_positions_only():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 300, generator=g)
    mask = torch.rand(4, 64, generator=g) > 0.3
    got = masked_scan(x, mask, None, moments=False, chunk_elems=None, fused=True)
    want = masked_scan(x, mask, None, moments=False, chunk_elems=None)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-6)
