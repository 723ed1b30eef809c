"""scan_many(): per tensor, the vector scan() gives, and a float64 NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probewire.instrument import batchscan
from probewire.instrument.batchscan import SMALL_ELEMS, scan_groups, scan_many
from probewire.instrument.scan import ScanFields as F
from probewire.instrument.scan import scan


def tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [
        torch.randn(s, generator=g)
        for s in [(3, 4), (100,), (0,), (16, 16), (12,), (100,), (SMALL_ELEMS + 1,)]
    ]
    out[1][3], out[1][5], out[1][7] = float("inf"), float("nan"), float("-inf")
    out[3][0, :3] = 0.0
    out[5].zero_()  # a zero tensor beside a same-sized one
    out += [torch.randn(256, generator=g).to(torch.bfloat16) for _ in range(2)]
    out += [torch.randn(7, generator=g, dtype=torch.float64) for _ in range(2)]
    return out


@pytest.mark.parametrize("moments", [False, True])
def test_rows_equal_the_single_tensor_scan(moments):
    xs = tensors()
    got = scan_many(xs, moments=moments)
    want = torch.stack([scan(x, moments=moments) for x in xs])
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-9)


def test_rows_against_a_float64_reference():
    xs = tensors()
    got = scan_many(xs).numpy()
    for row, x in zip(got, xs):
        a = x.to(torch.float64).numpy().ravel()
        f = a[np.isfinite(a)]
        assert row[F.N] == a.size and row[F.ZEROS] == np.count_nonzero(a == 0)
        assert row[F.NONFINITE] == np.count_nonzero(~np.isfinite(a))
        assert row[F.ABS_MAX] == pytest.approx(np.abs(f).max() if f.size else 0.0, rel=1e-7)
        assert row[F.SUM_SQ] == pytest.approx((f * f).sum(), rel=1e-5, abs=1e-6)
        assert row[F.SUM_ABS] == pytest.approx(np.abs(f).sum(), rel=1e-5, abs=1e-6)


def test_no_tensor_gives_an_empty_matrix():
    assert scan_many([]).shape == (0, 7)


def combined(rows: np.ndarray) -> np.ndarray:
    out = rows.sum(axis=0)
    out[F.ABS_MAX] = rows[:, F.ABS_MAX].max(initial=0.0)
    return out


@pytest.mark.parametrize("moments", [False, True])
@pytest.mark.parametrize("stack", [None, 200])
def test_group_rows_combine_to_the_per_tensor_rows_of_each_group(monkeypatch, moments, stack):
    """Groups of mixed sizes and dtypes, non-finite and zero elements, an empty tensor, one
    tensor above SMALL_ELEMS; with ``stack`` a group's concatenation splits into blocks."""
    if stack is not None:
        monkeypatch.setattr(batchscan, "STACK_ELEMS", stack)
    xs = tensors()
    groups = [i % 3 for i in range(len(xs))]
    rows, row_groups = scan_groups(xs, groups, moments=moments)
    per_tensor = scan_many(xs, moments=moments).numpy()
    got, want = rows.numpy(), per_tensor
    assert rows.dtype == torch.float64 and len(row_groups) == len(got)
    if stack is not None:
        assert len(got) > 6  # several blocks per group
    for g in set(groups):
        mine = combined(got[np.asarray(row_groups) == g])
        theirs = combined(want[np.asarray(groups) == g])
        a = np.concatenate(
            [x.to(torch.float64).numpy().ravel() for x, k in zip(xs, groups) if k == g]
        )
        f = a[np.isfinite(a)]
        assert mine[F.N] == a.size and mine[F.ZEROS] == np.count_nonzero(a == 0)
        assert mine[F.NONFINITE] == np.count_nonzero(~np.isfinite(a))
        assert mine[F.ABS_MAX] == pytest.approx(np.abs(f).max(), rel=1e-7)
        assert mine[F.SUM_ABS] == pytest.approx(np.abs(f).sum(), rel=1e-5)
        assert mine[F.SUM_SQ] == pytest.approx((f * f).sum(), rel=1e-5)
        assert mine[F.SUM] == pytest.approx(f.sum(), abs=1e-5 * np.abs(f).sum())
        assert np.allclose(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("moments", [False, True])
def test_gathered_blocks_are_copies_reduced_later_to_the_rows_of_the_values_then(moments):
    """``gather_groups`` copies the small tensors (a group of one tensor too, of mixed dtypes
    too); tensors changed in place afterwards (a clip, the next step) leave ``rows`` as the
    rows of the values at the gather, and the inputs are never written."""
    xs = tensors()
    groups = [0, 1, 1, 2, 1, 1, 1, 3, 3, 1, 1]  # group 0 and 2: one small tensor each
    before = [x.clone() for x in xs]
    want, want_groups = scan_groups(before, groups, moments=moments)
    gathered = batchscan.gather_groups(xs, batchscan.plan_groups(xs, groups), moments=moments)
    assert gathered.on_host
    for x in xs:
        x.mul_(0.5).add_(1.0)
    for x in xs:
        x.copy_(torch.ones_like(x))  # the reductions must not see these values
    got = gathered.rows()
    assert gathered.row_groups == want_groups
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    fresh = tensors()
    for x, y in zip(xs, fresh):
        x.copy_(y)
    gathered.rows()  # reducing again overwrites only the copies
    assert all(torch.equal(x.nan_to_num(), y.nan_to_num()) for x, y in zip(xs, fresh))


def test_a_compiled_or_device_group_scan_is_not_reduced_off_the_training_thread():
    one = [torch.ones(3)]
    plan = batchscan.plan_groups(one, [0])
    assert not batchscan.gather_groups(one, plan, fused=True).on_host
    assert batchscan.gather_groups(one, plan, fused=True, moments=True).on_host


def test_no_tensor_or_only_empty_ones_give_no_group_row():
    for xs, groups in (([], []), ([torch.zeros(0), torch.zeros(0, 3)], [0, 2])):
        rows, row_groups = scan_groups(xs, groups)
        assert rows.shape == (0, 7) and row_groups == []


@pytest.mark.parametrize(
    "block",
    [
        [torch.tensor([3e38, 3e38, -1.0, 0.0])],  # finite, but Σx overflows
        [torch.tensor([1.0, 0.0, 2.0]), torch.tensor([float("nan"), 0.0, -3.0])],
        [torch.tensor([1.0, 0.0, 2.0]), torch.tensor([4.0, 0.0, -3.0])],
    ],
)
def test_a_block_with_and_without_non_finite_elements_gives_the_single_tensor_scan(block):
    """On CPU an all-finite block skips the non-finite clean-up (``row_fields``); a block whose
    finite elements overflow Σx, or that holds a NaN, takes the full path."""
    got = scan_many(block)
    want = torch.stack([scan(x) for x in block])
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-12, atol=0)
    assert got[:, F.NONFINITE].tolist() == [float((~x.isfinite()).sum()) for x in block]
    assert got[:, F.ZEROS].tolist() == [float((x == 0).sum()) for x in block]
