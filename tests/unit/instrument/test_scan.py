"""scan(): every field against an independent float64 NumPy reference on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probewire.instrument.scan import (
    BASE_FIELDS,
    CPU_CHUNK_ELEMS,
    MOMENT_FIELDS,
    ScanFields,
    combine,
    combine_many,
    scan,
    summarize,
)

F = ScanFields
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def as_f64(x: torch.Tensor) -> np.ndarray:
    """The exact float64 values of ``x`` (bf16 has no NumPy dtype, so torch converts)."""
    return x.detach().to(torch.float64).numpy().ravel()


def reference(x: torch.Tensor) -> np.ndarray:
    a = as_f64(x)
    finite = np.isfinite(a)
    f = a[finite]
    return np.array(
        [
            a.size,
            f.sum(),
            (f * f).sum(),
            np.abs(f).sum(),
            np.abs(f).max() if f.size else 0.0,
            np.count_nonzero(a == 0),
            np.count_nonzero(~finite),
            (f**3).sum(),
            (f**4).sum(),
        ]
    )


def reference_kurtosis(x: torch.Tensor) -> float:
    f = as_f64(x)
    f = f[np.isfinite(f)]
    c = f - f.mean()
    return float(np.mean(c**4) / np.mean(c**2) ** 2 - 3.0)


def assert_matches(vec: torch.Tensor, ref: np.ndarray, *, rtol: float = 2e-6) -> None:
    v = vec.numpy()
    for field in (F.N, F.ZEROS, F.NONFINITE, F.ABS_MAX):
        assert v[field] == ref[field], field.name
    scale = max(ref[F.SUM_ABS], 1e-300)
    assert abs(v[F.SUM] - ref[F.SUM]) <= rtol * scale
    np.testing.assert_allclose(v[F.SUM_SQ], ref[F.SUM_SQ], rtol=rtol)
    np.testing.assert_allclose(v[F.SUM_ABS], ref[F.SUM_ABS], rtol=rtol)
    if len(v) == MOMENT_FIELDS:
        quad = max(ref[F.SUM_QUAD], 1e-300)
        assert abs(v[F.SUM_CUBE] - ref[F.SUM_CUBE]) <= 1e-12 * quad
        np.testing.assert_allclose(v[F.SUM_QUAD], ref[F.SUM_QUAD], rtol=1e-12)


def sample(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 3 + 0.5
    x[::11] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_elems", [None, 1000])
def test_fields_match_numpy(dtype: torch.dtype, chunk_elems: int | None) -> None:
    x = sample(10_007, dtype)
    vec = scan(x, chunk_elems=chunk_elems)
    assert vec.dtype == torch.float64 and vec.device == x.device and vec.shape == (BASE_FIELDS,)
    assert_matches(vec, reference(x)[:BASE_FIELDS])


@pytest.mark.parametrize("dtype", DTYPES)
def test_moment_fields_are_float64_exact(dtype: torch.dtype) -> None:
    x = sample(10_007, dtype, seed=1)
    vec = scan(x, moments=True, chunk_elems=1000)
    assert vec.shape == (MOMENT_FIELDS,)
    assert_matches(vec, reference(x), rtol=1e-12)


def test_summary_matches_numpy() -> None:
    x = sample(4099, torch.bfloat16, seed=2)
    x[7] = float("nan")
    a = as_f64(x)
    f = a[np.isfinite(a)]
    stats = summarize(scan(x, moments=True))
    assert stats.n == a.size and stats.nonfinite == 1
    np.testing.assert_allclose(stats.mean, f.mean(), rtol=1e-10)
    np.testing.assert_allclose(stats.m2, np.mean(f * f), rtol=1e-10)
    np.testing.assert_allclose(stats.rms, np.sqrt(np.mean(f * f)), rtol=1e-10)
    np.testing.assert_allclose(stats.abs_mean, np.abs(f).mean(), rtol=1e-10)
    assert stats.abs_max == np.abs(f).max()
    assert stats.zero_frac == np.count_nonzero(a == 0) / a.size
    np.testing.assert_allclose(stats.kurtosis, reference_kurtosis(x), rtol=1e-8)


def test_zero_tensor() -> None:
    x = torch.zeros(3, 5)
    vec = scan(x, moments=True)
    assert_matches(vec, reference(x), rtol=0)
    stats = summarize(vec)
    assert (stats.n, stats.mean, stats.m2, stats.abs_max, stats.zero_frac) == (15, 0, 0, 0, 1.0)
    assert stats.kurtosis is None


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0, 2)])
@pytest.mark.parametrize("moments", [False, True])
def test_empty_tensor_is_no_measurement(shape: tuple[int, ...], moments: bool) -> None:
    vec = scan(torch.empty(shape), moments=moments)
    assert vec.shape == ((MOMENT_FIELDS if moments else BASE_FIELDS),)
    assert not vec.any()
    stats = summarize(vec)
    assert all(getattr(stats, name) is None for name in stats.__slots__)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonfinite_counted_and_excluded(dtype: torch.dtype) -> None:
    x = sample(5000, dtype, seed=3)
    x[[3, 100, 2500]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    vec = scan(x, moments=True, chunk_elems=700)
    ref = reference(x)
    assert ref[F.NONFINITE] == 3
    assert_matches(vec, ref, rtol=1e-12)
    stats = summarize(vec)
    assert np.isfinite([stats.mean, stats.m2, stats.abs_max, stats.kurtosis]).all()


def test_all_nonfinite_has_no_finite_statistics() -> None:
    stats = summarize(scan(torch.tensor([float("nan"), float("inf"), -float("inf")])))
    assert (stats.n, stats.nonfinite, stats.zero_frac) == (3, 3, 0.0)
    assert stats.mean is None and stats.m2 is None and stats.abs_max is None


def test_chunked_scan_equals_single_pass() -> None:
    x = sample(10_007, torch.float32, seed=4)
    chunked, whole = scan(x, chunk_elems=1000), scan(x, chunk_elems=x.numel())
    assert chunked[F.N] == whole[F.N] and chunked[F.ZEROS] == whole[F.ZEROS]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)


def test_default_chunk_is_crossed() -> None:
    x = sample(2 * CPU_CHUNK_ELEMS + 17, torch.float32, seed=5)
    assert_matches(scan(x), reference(x)[:BASE_FIELDS])


@pytest.mark.parametrize("chunk_elems", [1000, 100])
def test_non_contiguous_tensor(chunk_elems: int) -> None:
    x = sample(21_000, torch.float32, seed=6).reshape(70, 300).t()[::2]
    assert not x.is_contiguous()
    assert_matches(scan(x, chunk_elems=chunk_elems), reference(x)[:BASE_FIELDS])


def test_combine_of_shards_equals_scan_of_concatenation() -> None:
    a, b = sample(3001, torch.float32, seed=7), sample(4003, torch.float32, seed=8) * 10
    a[5] = float("inf")
    joined = scan(torch.cat([a, b]))
    torch.testing.assert_close(combine(scan(a), scan(b)), joined, rtol=1e-6, atol=0)
    shards = torch.stack([scan(a), scan(torch.empty(0)), scan(b)])
    torch.testing.assert_close(combine_many(shards), joined, rtol=1e-6, atol=0)
    assert combine_many(shards)[F.ABS_MAX] == max(scan(a)[F.ABS_MAX], scan(b)[F.ABS_MAX])


def test_combine_many_of_nothing_is_the_empty_scan() -> None:
    assert not combine_many(torch.zeros(0, BASE_FIELDS)).any()


@pytest.mark.parametrize("x", [torch.full((1001,), 0.1), torch.zeros(10)], ids=["const", "zeros"])
def test_kurtosis_with_zero_variance_is_none(x: torch.Tensor) -> None:
    assert summarize(scan(x, moments=True, chunk_elems=100)).kurtosis is None


@pytest.mark.parametrize("heavy_tailed,offset,scale", [(True, 0.0, 1.0), (False, 1.0, 1e-2)])
def test_kurtosis_matches_numpy(heavy_tailed: bool, offset: float, scale: float) -> None:
    """Laplace data (κ = 3) and Gaussian data far from zero (κ = 0, cancellation-prone)."""
    g = torch.Generator().manual_seed(9)
    if heavy_tailed:
        u = torch.rand(20_000, generator=g, dtype=torch.float64) - 0.5
        x = -torch.sign(u) * torch.log1p(-2 * u.abs())
    else:
        x = torch.randn(20_000, generator=g, dtype=torch.float64)
    x = (x * scale + offset).float()
    got = summarize(scan(x, moments=True, chunk_elems=3000)).kurtosis
    np.testing.assert_allclose(got, reference_kurtosis(x), rtol=1e-9, atol=1e-6)


def test_kurtosis_absent_without_moments() -> None:
    assert summarize(scan(torch.randn(100))).kurtosis is None


def test_scan_reads_no_data_on_the_host() -> None:
    """Meta tensors have no data: any .item()/.cpu()/mask-indexing would raise here."""
    x = torch.empty(5000, dtype=torch.bfloat16, device="meta")
    for moments in (False, True):
        vec = scan(x, moments=moments, chunk_elems=1000)
        assert vec.device.type == "meta" and vec.dtype == torch.float64


def test_rejects_non_float_tensors() -> None:
    with pytest.raises(TypeError):
        scan(torch.arange(10))
