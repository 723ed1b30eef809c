"""The compiled one-pass scan gives the eager scan's vector (within float32 accumulation),
on the tensors and edge cases the tensor probes see; and a monitor configured for it
reports the same tensor statistics. Compiles once (10-20 s on a CPU core)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probewire.instrument.probes.head import HOST_REDUCE_POSITIONS, decode_head, output_head
from probewire.instrument.probes.tensors import masked_scan
from probewire.instrument.scan import ScanFields as F
from probewire.instrument.scan import fused_scan, scan

pytestmark = pytest.mark.integration

# Both passes sum in float32, in whatever order the compiled kernel's vector width and
# threads give: on this CPU a bf16 case's sum of squares differed by 3.4e-6 relative
# (652417.94 vs 652420.13), over the 2e-6 once used here; sqrt(n) * eps_f32 for 65,537
# elements is 1.5e-5
F32_SUM = 2e-5


def cases():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(1 << 20, generator=g) * 3 + 1
    with_specials = torch.randn(70_001, generator=g)
    with_specials[[3, 11, 500]] = torch.tensor([math.nan, math.inf, -math.inf])
    with_specials[100:140] = 0.0
    past_f32 = torch.zeros((1 << 24) + 3)  # counts a float32 cannot hold exactly
    past_f32[[5, 9]] = torch.tensor([math.nan, 1.5])
    return {
        "big": big,
        "specials": with_specials,
        "bf16": big[:65_537].bfloat16(),
        "past_f32": past_f32,
        "zeros": torch.zeros(3, 5, 7),
        "empty": torch.empty(0),
        "strided": torch.randn(64, 300, generator=g).t(),
    }


@pytest.mark.parametrize("name", sorted(cases()))
def test_fused_scan_equals_the_eager_scan(name):
    x = cases()[name]
    got, want = fused_scan(x), scan(x)
    for field in (F.N, F.ZEROS, F.NONFINITE, F.ABS_MAX):
        assert got[field] == want[field], field.name
    for field in (F.SUM, F.SUM_SQ, F.SUM_ABS):
        assert float(got[field]) == pytest.approx(float(want[field]), rel=F32_SUM, abs=1e-3)


def test_fused_scan_in_parts_past_its_int32_counts(monkeypatch):
    """Past FUSED_MAX_ELEMS elements the compiled pass runs per part (its counts are int32)
    and the parts combine to the eager scan's vector: non-finite elements and zeros in
    several parts, the maximum in the last."""
    from probewire.instrument import scan as scan_module

    monkeypatch.setattr(scan_module, "FUSED_MAX_ELEMS", 30_000)
    x = cases()["specials"].clone()  # 70,001 elements: parts of 30,000, 30,000, 10,001
    x[[40_000, 65_000]] = torch.tensor([math.nan, -math.inf])
    x[69_999] = 1e4
    got, want = fused_scan(x), scan(x)
    for field in (F.N, F.ZEROS, F.NONFINITE, F.ABS_MAX):
        assert got[field] == want[field], field.name
    assert int(got[F.NONFINITE]) == 5 and float(got[F.ABS_MAX]) == 1e4
    for field in (F.SUM, F.SUM_SQ, F.SUM_ABS):
        assert float(got[field]) == pytest.approx(float(want[field]), rel=F32_SUM, abs=1e-3)


def test_masked_fused_scan_covers_valid_positions_only():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 300, generator=g)
    mask = torch.rand(4, 64, generator=g) > 0.3
    got = masked_scan(x, mask, None, moments=False, chunk_elems=None, fused=True)
    want = masked_scan(x, mask, None, moments=False, chunk_elems=None)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-6)


def test_gradient_groups_through_the_fused_scan_equal_the_float64_reference(monkeypatch):
    """scan_groups(fused=True): large tensors and small-tensor blocks each through the one
    compiled pass; combined per group they give the float64 values (non-finite elements,
    zeros, bfloat16, an empty tensor, several blocks)."""
    from probewire.instrument import batchscan

    monkeypatch.setattr(batchscan, "STACK_ELEMS", 300)
    g = torch.Generator().manual_seed(2)
    xs = [*cases().values(), *(torch.randn(s, generator=g) for s in (100, 250, 17, 64, 3))]
    groups = [i % 2 for i in range(len(xs))]
    rows, row_groups = batchscan.scan_groups(xs, groups, fused=True)
    eager, eager_groups = batchscan.scan_groups(xs, groups)
    assert row_groups == eager_groups and len(row_groups) > len(set(groups)) + 2
    for group in (0, 1):
        mine = rows.numpy()[np.asarray(row_groups) == group]
        a = np.concatenate([x.double().numpy().ravel() for x, k in zip(xs, groups) if k == group])
        f = a[np.isfinite(a)]
        assert mine[:, F.N].sum() == a.size and mine[:, F.ZEROS].sum() == np.count_nonzero(a == 0)
        assert mine[:, F.NONFINITE].sum() == np.count_nonzero(~np.isfinite(a))
        assert mine[:, F.ABS_MAX].max() == pytest.approx(np.abs(f).max(), rel=1e-7)
        assert mine[:, F.SUM_ABS].sum() == pytest.approx(np.abs(f).sum(), rel=2e-6)
        assert mine[:, F.SUM_SQ].sum() == pytest.approx((f * f).sum(), rel=2e-6)
        np.testing.assert_allclose(
            mine, eager.numpy()[np.asarray(eager_groups) == group], rtol=F32_SUM, atol=1e-3
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq", [7, HOST_REDUCE_POSITIONS // 2])  # rows to the host, reduced
def test_fused_output_head_is_the_float64_reference_over_valid_positions(dtype, seq):
    """The compiled one-pass head statistics: padding that holds garbage (1e6, NaN) left
    out, then a NaN logit at a valid position propagates; two micro-batches."""
    g = torch.Generator().manual_seed(5)
    z = (3 * torch.randn(4, seq, 11, generator=g)).to(dtype)
    mask = torch.rand(4, seq, generator=g) > 0.4
    z[~mask] = 1e6
    z[0, 0, 0] = float("nan") if not mask[0, 0] else z[0, 0, 0]
    rows = z[mask].double().numpy()

    def decoded(z):
        parts = [
            output_head(z[half], mask[half], fused=True) for half in (slice(0, 3), slice(3, 4))
        ]
        return {
            p.name: p.value
            for p in decode_head(
                [
                    (torch.cat([t.reshape(-1).double() for t in vec]).numpy(), meta)
                    for vec, meta in parts
                ]
            )
        }

    got = decoded(z)
    assert got["output.logits_n"] == rows.size
    assert got["output.logits_abs_max"] == pytest.approx(np.abs(rows).max(), rel=1e-7)
    assert got["output.logits_sum_sq"] == pytest.approx((rows**2).sum(), rel=1e-5)
    i, j = map(int, mask.nonzero()[0])
    z[i, j, 3] = float("nan")
    got = decoded(z)
    assert math.isnan(got["output.logits_abs_max"]) and math.isnan(got["output.logits_sum_sq"])


def test_a_monitor_on_the_compiled_backend_reports_the_eager_gradient_groups(monkeypatch):
    import torch.nn.functional as F_

    from probewire.deploy.demo.model import TinyConfig, TinyLM
    from probewire.instrument import batchscan
    from probewire.instrument import scan as scan_module
    from probewire.instrument.probes import head

    compiled_rows = torch.compile(head._row_stats, dynamic=True)
    from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
    from probewire.instrument.wire import decode_rank_step

    def grad_points(backend: str) -> dict:
        torch.manual_seed(0)
        model = TinyLM(TinyConfig(seq_len=8, d_model=16, n_layer=2, n_head=2))
        transport = MemoryTransport()
        monitor = attach(
            model,
            None,
            transport=transport,
            identity=RankIdentity(run_id="t", rank=0, world_size=1),
            config=ProbeConfig(
                cadence={"step": 1, "scan": 0, "demand": 0},
                scan_backend=backend,
                telemetry=False,
                comm=False,
            ),
        )
        tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
        with monitor.step(0) as s:
            logits = model(tokens)
            F_.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)).backward()
            s.gradients()
        monitor.close()
        [rec] = [decode_rank_step(k, v) for k, v in transport.messages]
        return {
            key: v for key, v in rec.values.items() if key[0].startswith(("grad.", "output.logits"))
        }

    calls, heads = [], []
    monkeypatch.setattr(batchscan, "fused_scan", lambda x: calls.append(x) or fused_scan(x))
    monkeypatch.setitem(
        scan_module._compiled, head._row_stats, lambda z: heads.append(z) or compiled_rows(z)
    )
    eager = grad_points("eager")
    assert not calls and not heads
    compiled = grad_points("compiled")
    assert len(calls) >= 2  # every step's gradient groups went through the compiled pass
    assert len(heads) == 1  # and the step's logits through the compiled head
    assert eager.keys() == compiled.keys() and len(eager) >= 19
    for key, value in eager.items():
        assert compiled[key] == pytest.approx(value, rel=2e-6), key
