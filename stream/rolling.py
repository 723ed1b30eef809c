"""Median, MAD and quantile of a window kept in ascending order, equal to NumPy's float64
results bit for bit, at a few list operations instead of a NumPy call per step.

The spike detectors (``detect``) keep each rolling window twice: in arrival order (which
value leaves next) and ascending (``bisect.insort`` in, ``del`` out, O(window) moves).
A window holds logs of positive finite values, so it never holds NaN, +-inf or -0.0,
the cases where these functions and NumPy could differ.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

__all__ = ["sorted_median", "sorted_median_mad", "sorted_quantile"]


def sorted_median(ordered: Sequence[float]) -> float:
    """``np.median`` of an ascending, non-empty sequence without NaN or -0.0 (a window of
    logs or of absolute deviations), bit for bit: the middle value, or (a + b) / 2 of the
    two middle values (NumPy's mean of two elements)."""
    n = len(ordered)
    half = n // 2
    if n % 2:
        return ordered[half]
    return (ordered[half - 1] + ordered[half]) / 2


def sorted_quantile(ordered: Sequence[float], quantile: float) -> float:
    """``np.quantile(values, quantile)`` (default ``method="linear"``) of the ascending,
    non-empty sequence ``ordered`` of the same values, bit for bit: virtual index
    (n - 1) q, and NumPy's two-sided lerp (from the upper neighbour when gamma >= 0.5).
    Like ``sorted_median``, for windows without -0.0."""
    n = len(ordered)
    virtual = (n - 1) * quantile
    if virtual >= n - 1:
        return ordered[-1]
    below = math.floor(virtual)
    gamma = virtual - below
    a, b = ordered[below], ordered[below + 1]
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


def sorted_median_mad(ordered: Sequence[float]) -> tuple[float, float]:
    """``detect.median_mad`` of an ascending, non-empty sequence (no NaN, no -0.0), bit for
    bit, without NumPy and without building the deviations: those of a sorted window are
    two ascending runs (q - u left of the median, u - q right of it), so the middle one or
    two come from ``_kth_deviation`` in O(log n)."""
    q = sorted_median(ordered)
    n, split = len(ordered), bisect_left(ordered, q)
    half = n // 2
    if n % 2:
        return q, _kth_deviation(ordered, split, q, half)
    low, high = (_kth_deviation(ordered, split, q, k) for k in (half - 1, half))
    return q, (low + high) / 2


def _kth_deviation(ordered: Sequence[float], split: int, q: float, k: int) -> float:
    """The k-th smallest (from 0) of |u - q| over ``ordered``: left of ``split`` q - u,
    right of it u - q, each run ascending; a bisection on how many of the k + 1 smallest
    are left ones. fl(q - u) is -fl(u - q) (round to nearest), so each is abs(u - q)."""
    n_right = len(ordered) - split

    def left(i: int) -> float:
        return q - ordered[split - 1 - i]

    def right(j: int) -> float:
        return ordered[split + j] - q

    lo, hi = max(0, k + 1 - n_right), min(k + 1, split)
    while lo < hi:
        i = (lo + hi) // 2
        if left(i) < right(k - i):
            lo = i + 1
        else:
            hi = i
    i, j = lo, k + 1 - lo
    if i == 0:
        return right(j - 1)
    if j == 0:
        return left(i - 1)
    return max(left(i - 1), right(j - 1))
