"""Per-token statistics as token blocks: count, sum, p90, p99, max over valid tokens.

Quantiles are taken over tokens, never over the flattened tokens × features (seeds §8,
"Aggregation"). A rank ships the "higher" order statistic so the stream can bound the
global quantile with a maximum over ranks (``quantile_bound``); quantiles are never
averaged. Used by the residual-path and top-k margin probes.
"""

from __future__ import annotations

import enum
import math

import torch

__all__ = ["TokenField", "quantile_bound", "token_quantiles"]


class TokenField(enum.IntEnum):
    """Columns of a token block."""

    COUNT, SUM, P90, P99, MAX = range(5)


def token_quantiles(
    values: torch.Tensor, valid: torch.Tensor, *, method: str = "linear"
) -> torch.Tensor:
    """Token block(s) of per-token ``values`` [T] or [T, C] over tokens with ``valid`` [T].

    Returns float64 [5] (or [C, 5]) in ``TokenField`` order. The q-quantile interpolates
    linearly between the order statistics around rank q·(n − 1) of the n valid tokens
    (``method="linear"``, numpy's default) or takes the upper one of them
    (``method="higher"``, numpy's "higher": the order statistic at index ⌈q·(n − 1)⌉).
    "higher" is what a rank ships when the stream bounds the global quantile by the
    maximum over ranks: at least q·n_r of rank r's tokens lie at or below its value, so
    the maximum over ranks is an upper bound of the global quantile (linear or higher);
    interpolated rank values are not (ranks {0, 10} and {0, 10}: 9 each, global 10).
    Invalid tokens are set to NaN, which ``sort`` places last, so they never enter. With
    n = 0 the block has COUNT = 0 and its other fields mean nothing.
    """
    if method not in ("linear", "higher"):
        raise ValueError(f"method must be 'linear' or 'higher', got {method!r}")
    flat = values.detach().reshape(values.shape[0], math.prod(values.shape[1:])).to(torch.float64)
    if flat.shape[0] == 0:
        block = flat.new_zeros((flat.shape[1], len(TokenField)))
        return block[0] if values.dim() == 1 else block
    mask = valid.reshape(-1, 1)
    count = valid.sum()
    total = torch.where(mask, flat, 0.0).sum(dim=0)
    peak = torch.where(mask, flat, -math.inf).amax(dim=0)
    ordered = torch.where(mask, flat, math.nan).sort(dim=0).values
    last = (count - 1).clamp(min=0)
    p90, p99 = (_sorted_quantile(ordered, last, q, method == "higher") for q in (0.90, 0.99))
    block = torch.stack([count.to(torch.float64).expand_as(total), total, p90, p99, peak], -1)
    return block[0] if values.dim() == 1 else block


def _sorted_quantile(
    ordered: torch.Tensor, last: torch.Tensor, q: float, higher: bool = False
) -> torch.Tensor:
    position = last.to(torch.float64) * q
    low = position.floor()
    frac = position - low
    low_i = low.long().expand(1, ordered.shape[1])
    lo = ordered.gather(0, low_i)[0]
    hi = ordered.gather(0, torch.minimum(low_i + 1, last))[0]
    if higher:
        return torch.where(frac > 0, hi, lo)
    return torch.where(frac > 0, lo + frac * (hi - lo), lo)


def quantile_bound(per_rank: list[float]) -> float:
    """The stream's cross-rank value of a per-rank token quantile: the maximum.

    Rank r sends Q_r, the order statistic at index ⌈q·(n_r − 1)⌉ of its n_r tokens, so at
    least ⌈q·(n_r − 1)⌉ + 1 ≥ q·n_r of them are ≤ Q_r. With Q = max_r Q_r, at least
    Σ_r(⌈q(n_r − 1)⌉ + 1) ≥ q·(N − 1) + 1 of all N tokens are ≤ Q, so the global
    q-quantile (by the same rule, or interpolated, which is never larger) is ≤ Q. Exact with
    one rank; rank-local *interpolated* quantiles would not bound it (ranks {0, 10} and
    {0, 10} at q = 0.9: 9 each, global 10)."""
    return max(per_rank)
