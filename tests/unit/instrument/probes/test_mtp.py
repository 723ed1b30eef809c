"""MTP top-1 agreement on aligned targets against NumPy."""

from __future__ import annotations

import numpy as np
import torch
from probe_helpers import f64, gen

from probewire.instrument.catalog import Output
from probewire.instrument.probes.mtp import decode_mtp, mtp_top1_agreement


def test_mtp_top1_agreement_on_aligned_targets() -> None:
    batch, seq, vocab, depth = 3, 12, 7, 1
    main = torch.randn(batch, seq, vocab, generator=gen(16))
    mtp = main + 0.8 * torch.randn(batch, seq, vocab, generator=gen(17))
    target_valid = torch.rand(batch, seq, generator=gen(18)) > 0.2
    # main row t predicts token t+1; MTP depth 1 at row t predicts token t+2 = main row t+1
    aligned_main, aligned_mtp = main[:, depth:], mtp[:, : seq - depth]
    valid = target_valid[:, depth:]
    vec = mtp_top1_agreement(aligned_main, aligned_mtp, valid)
    m = f64(valid).astype(bool)
    same = f64(aligned_main).argmax(-1) == f64(aligned_mtp).argmax(-1)
    assert vec.tolist() == [m.sum(), (same & m).sum()]
    got = {p.name: p.value for p in decode_mtp([(vec.numpy(), depth)])}
    np.testing.assert_allclose(
        got[Output.MTP_AGREE] / got[Output.MTP_POSITIONS], (same & m).sum() / m.sum()
    )
    assert decode_mtp([(np.zeros(2), depth)]) == []  # no aligned position: no measurement
