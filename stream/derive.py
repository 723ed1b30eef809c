"""Cross-rank reductions and derived series (seeds 001 §3-§9): what stage 2's view
(``view.p0_view``) calls for every step, and nothing it does not.

Ranks send reducible components (sums, counts, maxima, local times); stage 1 reduces
them; these pure functions turn them into the reported values. ``None`` means "not
measured" (no valid token, no rank, no expert load, no time), never a zero. Malformed
components (negative counts, mismatched lengths, a loss sum on a rank with no tokens)
raise ValueError naming the argument: the stream's bounds (``validate``) refuse them
before they get here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .rolling import sorted_median

__all__ = [
    "ExpertBalance",
    "GradStats",
    "compute_rate",
    "comm_wait_frac",
    "dead_expert_ratio",
    "grad_stats",
    "expert_balance",
    "global_mean_loss",
    "norm_from_squares",
    "loss_by_group",
    "mean_from_components",
    "mean_max_violation",
    "media_scale",
    "memory_headroom",
    "own_time_ratios",
    "ratio_from_components",
    "own_times",
    "rank_means",
    "ratios_by_label",
    "rms_from_components",
    "shard_imbalance",
    "shares",
    "Spread",
    "spread",
    "straggler_score",
    "token_rate",
    "update_ratio",
    "worst_rank_loss",
]


def _vector(name: str, values: Sequence[float]) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence, got shape {array.shape}")
    return array


def _counts(name: str, values: Sequence[float]) -> np.ndarray:
    array = _vector(name, values)
    if not (np.all(np.isfinite(array)) and np.all(array >= 0)):
        raise ValueError(f"{name} must hold finite values >= 0")
    return array


def _loss_components(
    loss_sums: Sequence[float], token_counts: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    sums = _vector("loss_sums", loss_sums)
    counts = _counts("token_counts", token_counts)
    if sums.shape != counts.shape:
        raise ValueError(f"loss_sums has {sums.size} ranks but token_counts has {counts.size}")
    if np.any(sums[counts == 0] != 0):
        raise ValueError("loss_sums must be 0 on a rank whose token_counts is 0")
    return sums, counts


_FEW_SUMMED, _FEW = 8, 128
"""NumPy sums fewer than 8 float64 values one after the other, from 0.0 (the last block of
its pairwise sum): the view's loss formulas run in Python on that few values (a sum) or up
to 128 (no sum: the worst rank), bit for bit the same, where NumPy's per-call cost was
most of their time (tests/unit/stream/test_derive.py checks both paths against each
other); past that NumPy's per-element cost is the lower."""


def _few_loss_components(
    loss_sums: Sequence[float], token_counts: Sequence[float], few: int
) -> tuple[list[float], list[float]] | None:
    """``_loss_components`` as Python floats, with its checks and messages, for lists or
    tuples of fewer than ``few`` floats or ints; None for anything else (NumPy's path)."""
    if not (
        type(loss_sums) in (list, tuple)
        and type(token_counts) in (list, tuple)
        and len(loss_sums) < few
        and len(token_counts) < few
        and all(type(x) in (float, int) for x in (*loss_sums, *token_counts))
    ):
        return None
    sums, counts = [float(x) for x in loss_sums], [float(x) for x in token_counts]
    if not all(math.isfinite(n) and n >= 0 for n in counts):
        raise ValueError("token_counts must hold finite values >= 0")
    if len(sums) != len(counts):
        raise ValueError(f"loss_sums has {len(sums)} ranks but token_counts has {len(counts)}")
    if any(s != 0 for s, n in zip(sums, counts) if n == 0):
        raise ValueError("loss_sums must be 0 on a rank whose token_counts is 0")
    return sums, counts


def _sequential_sum(values: list[float]) -> float:
    """``float(np.sum(values))`` for fewer than ``_FEW_SUMMED`` values: their sum in order."""
    total = 0.0
    for value in values:
        total += value
    return total


def _worst_of_few(sums: list[float], counts: list[float]) -> tuple[float, int] | None:
    """``worst_rank_loss`` of checked Python floats: the same divisions, the first NaN
    mean, else the first largest (``np.argmax``)."""
    ranks = [r for r, n in enumerate(counts) if n > 0]
    if not ranks:
        return None
    best, value = ranks[0], sums[ranks[0]] / counts[ranks[0]]
    for r in ranks:
        mean = sums[r] / counts[r]
        if mean != mean:  # NaN: the worst, the first one
            return mean, r
        if mean > value:
            best, value = r, mean
    return value, best


def _scalar(name: str, value: float, *, positive: bool) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def global_mean_loss(loss_sums: Sequence[float], token_counts: Sequence[float]) -> float | None:
    """L = sum_r S_r / sum_r N_r over per-rank valid-token loss sums S_r and counts N_r.

    Reduction: sum the two components separately, then divide; never average rank
    means (seeds 001 §3). None when no rank has a valid token.
    """
    few = _few_loss_components(loss_sums, token_counts, _FEW_SUMMED)
    if few is not None:  # NumPy's sum of under 8 values, in Python (bit for bit)
        total = _sequential_sum(few[1])
        return None if total == 0 else _sequential_sum(few[0]) / total
    sums, counts = _loss_components(loss_sums, token_counts)
    total = float(np.sum(counts))
    if total == 0:
        return None
    return float(np.sum(sums)) / total


def worst_rank_loss(
    loss_sums: Sequence[float], token_counts: Sequence[float]
) -> tuple[float, int] | None:
    """L_max = max_r L_r with L_r = S_r / N_r, returned with the rank index r.

    Reduction: max over GPU ranks (seeds 001 §3). Ranks with N_r = 0 are skipped,
    never scored as 0; None when every rank is empty. Ties go to the lowest rank; a
    NaN rank mean counts as the worst (the first NaN rank is returned).
    """
    few = _few_loss_components(loss_sums, token_counts, _FEW)
    if few is not None:
        return _worst_of_few(*few)
    sums, counts = _loss_components(loss_sums, token_counts)
    ranks = np.flatnonzero(counts > 0)
    if ranks.size == 0:
        return None
    with np.errstate(over="ignore"):  # a huge finite sum over few tokens is +-inf: worst
        means = sums[ranks] / counts[ranks]
    nan_at = np.flatnonzero(np.isnan(means))
    best = int(nan_at[0]) if nan_at.size else int(np.argmax(means))
    return float(means[best]), int(ranks[best])


def loss_by_group(
    sums_by_group: Mapping[str, Sequence[float]],
    counts_by_group: Mapping[str, Sequence[float]],
    total_tokens: float | None = None,
) -> dict[str, tuple[float, float, float]]:
    """Per data source or modality mu: (L_mu, pi_mu, N_mu) (seeds 001 §3).

    L_mu = sum_r S_r^mu / sum_r N_r^mu (per-rank components summed separately);
    pi_mu = N_mu / N_valid with N_mu = sum_r N_r^mu. N_valid is ``total_tokens`` when
    given (the step's valid tokens; NaN shares when it is 0: not measured; a share above
    1 shows a group counted beyond them, left visible), else the sum over all groups
    (groups partitioning the valid tokens). A group with no valid token is left out, not
    reported as zero.
    """
    if set(sums_by_group) != set(counts_by_group):
        raise ValueError("sums_by_group and counts_by_group must have the same groups")
    totals: dict[str, tuple[float, float]] = {}
    for group, sums in sums_by_group.items():
        s, n = _loss_components(sums, counts_by_group[group])
        totals[group] = (float(np.sum(s)), float(np.sum(n)))
    if total_tokens is None:
        valid = float(np.sum([n for _, n in totals.values()], dtype=np.float64))
    else:
        valid = _scalar("total_tokens", total_tokens, positive=False)
    return {
        group: (s / n, n / valid if valid else math.nan, n)
        for group, (s, n) in totals.items()
        if n > 0
    }


def norm_from_squares(norm_sq: float | None) -> float | None:
    """G_2 = sqrt(sum_p g_p^2) from the squared norm summed over the parameters' owners
    (seeds 001 §4). None when no rank reported it; NaN for a NaN or negative sum (a
    non-finite gradient stays visible), +inf for +inf."""
    if norm_sq is None:
        return None
    return math.sqrt(norm_sq) if norm_sq >= 0 else math.nan


def token_rate(n_tok: float, tau: float | None) -> float | None:
    """TPS = N_tok / tau: a step's global valid tokens over its global wall time tau (the
    max of the ranks' step times, stage 1's reduction) (seeds 001 §5). None without a
    time (no rank reported one, or 0 s)."""
    if tau is None or tau == 0:
        return None
    return _scalar("n_tok", n_tok, positive=False) / _scalar("tau", tau, positive=True)


def compute_rate(flops_step: float | None, n_devices: int, tau: float | None) -> float | None:
    """Phi = F_step / (D * tau): estimated operations per device-second (seeds 001 §5).
    None without an estimate or a time."""
    if n_devices < 1:
        raise ValueError(f"n_devices must be >= 1, got {n_devices!r}")
    if flops_step is None or tau is None or tau == 0:
        return None
    flops = _scalar("flops_step", flops_step, positive=False)
    return flops / (n_devices * _scalar("tau", tau, positive=True))


def straggler_score(step_times: Sequence[float], eps: float = 1e-8) -> float | None:
    """S = max_r tau_r / (median_r tau_r + eps) (seeds 001 §5). None with no rank.

    S is about 1 when ranks move together and grows when one slow rank sets the pace.
    """
    times = sorted(float(t) + 0.0 for t in step_times)  # + 0.0: no -0.0
    if not all(math.isfinite(t) and t >= 0 for t in times):
        raise ValueError("step_times must hold finite values >= 0")
    if not times:
        return None
    return times[-1] / (sorted_median(times) + _scalar("eps", eps, positive=True))


OWN_FLOOR = 0.05
"""The smallest own time a rank is credited with, as a fraction of its step time: a rank
whose reported wait covers its whole step (clock or measurement skew) would otherwise
have an own time of 0, and a ratio against it no bound (the old clamp reached 2e11)."""


def own_times(
    step_times: Mapping[int, float], waits: Mapping[int, float], floor: float = OWN_FLOOR
) -> dict[int, float]:
    """Per rank r its own time o_r = tau_r - min(max(w_r, 0), tau_r), at least floor * tau_r.

    ``waits`` holds the exposed collective wait w_r each rank reported (summed over ops;
    a rank that reported none has w_r = 0). The wait is clamped into [0, tau_r]: a wait
    can never exceed the step it is part of, so a longer one is skew, not time. Under
    synchronous data parallelism every rank's tau_r carries the slowest rank's delay; o_r
    does not (seeds 001 §5, exposed collective wait). Ranks with a non-finite or
    non-positive step time are left out (no measurement)."""
    if not 0.0 < floor < 1.0:
        raise ValueError(f"floor must be in (0, 1), got {floor!r}")
    own: dict[int, float] = {}
    for rank, tau in step_times.items():
        tau = float(tau)
        if not (math.isfinite(tau) and tau > 0.0):
            continue
        wait = float(waits.get(rank, 0.0))
        wait = min(max(wait, 0.0), tau) if math.isfinite(wait) else 0.0
        own[rank] = max(tau - wait, floor * tau)
    return own


def own_time_ratios(own: Mapping[int, float]) -> dict[int, float]:
    """rho_r = o_r / median_{j != r} o_j for every rank: its own time against the other
    ranks' (leave-one-out median), so load the whole host shares cancels. {} with fewer
    than two ranks; own times must be > 0 (``own_times`` floors them)."""
    if len(own) < 2:
        return {}
    ranks = sorted(own)
    values = [float(own[r]) for r in ranks]
    order = sorted(range(len(ranks)), key=values.__getitem__)
    ordered = [values[i] for i in order]
    m, odd = divmod(len(ranks) - 1, 2)  # the median's place among the n - 1 values left
    ratios: dict[int, float] = {}
    for place, i in enumerate(order):  # rank i holds place ``place`` in the sorted values
        # the j-th of the rest is ordered[j] before that place, ordered[j + 1] from it on
        upper = ordered[m] if m < place else ordered[m + 1]
        if odd:
            median = upper
        else:
            median = 0.5 * ((ordered[m - 1] if m - 1 < place else ordered[m]) + upper)
        ratios[ranks[i]] = values[i] / median
    return dict(sorted(ratios.items()))


def rank_means(
    loss_sums: Mapping[int, float], token_counts: Mapping[int, float]
) -> dict[int, float]:
    """L_r = S_r / N_r per rank (seeds 001 §3, local mean loss); a rank with no valid token,
    or with only one of the two components, has no measurement and is left out."""
    return {
        r: float(loss_sums[r]) / float(n)
        for r, n in token_counts.items()
        if r in loss_sums and n > 0
    }


@dataclass(frozen=True, slots=True)
class ExpertBalance:
    """Balance of one MoE layer's valid-token loads c_i over E experts (seeds 001 §7).

    imbalance I = max c_i / mean c; max_violation = I - 1; entropy H = -sum p_i log p_i
    with p_i = c_i / sum c and 0 log 0 = 0; entropy_norm = H / log E (None when E = 1);
    dead_ratio = fraction of experts with c_i = 0.
    """

    n_experts: int
    total_tokens: float
    imbalance: float
    max_violation: float
    entropy: float
    entropy_norm: float | None
    dead_ratio: float


def expert_balance(counts: Sequence[float]) -> ExpertBalance | None:
    """Imbalance, MaxVio, routing entropy and dead-expert ratio of one layer (seeds 001 §7).

    Reduction: per-expert counts are summed over ranks before this call. None when
    no valid token reached the layer (an empty layer is not a measured zero).
    """
    c = _counts("counts", counts)
    total = float(np.sum(c))
    if total == 0:
        return None
    n_experts = c.size
    imbalance = float(np.max(c)) / (total / n_experts)
    p = c[c > 0] / total
    entropy = float(-np.sum(p * np.log(p)))
    return ExpertBalance(
        n_experts=n_experts,
        total_tokens=total,
        imbalance=imbalance,
        max_violation=imbalance - 1.0,
        entropy=entropy,
        entropy_norm=entropy / math.log(n_experts) if n_experts > 1 else None,
        dead_ratio=float(np.count_nonzero(c == 0)) / n_experts,
    )


def shard_imbalance(counts: Sequence[float], shard_of_expert: Sequence[int]) -> float | None:
    """max_s C_s / mean_s C_s with shard load C_s = sum of c_i over experts on shard s.

    Same ratio as I, over expert-parallel shard loads (seeds 001 §7). Shards are
    numbered 0..S-1 and each must own at least one expert. None when the layer
    received no valid token.
    """
    c = _counts("counts", counts)
    shards = np.asarray(shard_of_expert)
    if shards.shape != c.shape or (shards.size and not np.issubdtype(shards.dtype, np.integer)):
        raise ValueError("shard_of_expert must give one integer shard id per expert")
    if shards.size and (shards.min() < 0 or np.unique(shards).size != shards.max() + 1):
        raise ValueError("shard_of_expert must use every shard id 0..S-1 and nothing else")
    total = float(np.sum(c))
    if total == 0:
        return None
    loads = np.bincount(shards, weights=c)
    return float(np.max(loads)) / (total / loads.size)


def mean_from_components(s: float, n: float) -> float | None:
    """Mean = sum x / N from the cross-rank sums of x and of N (seeds 001 §6). None at N = 0."""
    count = _scalar("n", n, positive=False)
    return float(s) / count if count > 0 else None


def rms_from_components(sum_sq: float, count: float) -> float | None:
    """RMS = sqrt(sum x^2 / N) from the cross-rank sums of x^2 and of N (seeds 001 §6).

    None at N = 0. A NaN or +inf sum (a tensor holding one) propagates.
    """
    n = _scalar("count", count, positive=False)
    if sum_sq < 0:
        raise ValueError(f"sum_sq must be >= 0, got {sum_sq!r}")
    return math.sqrt(float(sum_sq) / n) if n > 0 else None


def media_scale(
    media_sum_sq: float | None,
    media_n: float | None,
    text_sum_sq: float | None,
    text_n: float | None,
    eps: float = 1e-12,
) -> float | None:
    """gamma = RMS(e_media) / (RMS(e_text) + eps) over the embeddings entering the backbone,
    each RMS from its cross-rank sum of squares and element count (seeds 001 §9). None
    unless all four were reported and both counts are > 0; NaN for a NaN or negative sum
    of squares (not a measurement, but visible)."""
    if media_sum_sq is None or text_sum_sq is None or not media_n or not text_n:
        return None
    if not (media_sum_sq >= 0 and text_sum_sq >= 0):
        return math.nan
    media, text = (
        rms_from_components(media_sum_sq, media_n),
        rms_from_components(text_sum_sq, text_n),
    )
    if media is None or text is None:  # counts checked > 0 above: not reached
        return None
    return media / (text + _scalar("eps", eps, positive=True))


def ratio_from_components(part: float | None, whole: float | None) -> float | None:
    """part / whole from two cross-rank sums (a share, a fraction, a mean): the top-2 tie
    fraction and mean gap (002), MTP agreement (002), S_enc (001 §9). None unless both were
    reported and ``whole`` > 0 (nothing measured is not a zero); a NaN part propagates."""
    if part is None or whole is None:
        return None
    if math.isnan(whole):
        return math.nan
    whole = _scalar("whole", whole, positive=False)
    return float(part) / whole if whole > 0 else None


@dataclass(frozen=True, slots=True)
class GradStats:
    """G_mean, G_max and Z_g of one parameter group (seeds 001 §4)."""

    abs_mean: float | None
    abs_max: float | None
    zero_frac: float | None


def grad_stats(
    abs_sum: float | None,
    abs_max: float | None,
    zeros: float | None,
    elements: float | None,
    nonfinite: float | None,
) -> GradStats | None:
    """G_mean = Σ|g| / (P − non-finite) (Σ|g| runs over finite elements), G_max = max |g|,
    Z_g = zeros / P, from the cross-rank sums (max for G_max) of the gradient components
    (seeds 001 §4). None when no element was reported (P absent or 0); a mean over no
    finite element is None."""
    if elements is None or abs_sum is None or zeros is None:
        return None
    p = _scalar("elements", elements, positive=False)
    if p == 0:
        return None
    finite = p - _scalar("nonfinite", nonfinite or 0.0, positive=False)
    return GradStats(
        abs_mean=float(abs_sum) / finite if finite > 0 else None,
        abs_max=abs_max,
        zero_frac=_scalar("zeros", zeros, positive=False) / p,
    )


def comm_wait_frac(waits: Mapping[int, float], tau: float | None) -> float | None:
    """W_comm = τ_wait / τ (seeds 001 §5): the largest exposed collective wait of a rank
    (its waits summed over ops, clamped into [0, τ]) over the step's global wall time τ.
    None without a wait or a time."""
    finite = [float(w) for w in waits.values() if math.isfinite(w)]
    if not finite or tau is None or not tau > 0:
        return None
    tau = _scalar("tau", tau, positive=True)
    return min(max(max(finite), 0.0), tau) / tau


def update_ratio(update_sum_sq: float, param_sum_sq: float, eps: float = 1e-12) -> float | None:
    """ρ = ‖Δw‖ / (‖w‖ + ε) over the scanned parameters (seeds 001 §6: RMS(Δw)/RMS(w) with
    the same elements on both sides, so the element counts cancel), from the cross-rank
    sums of Δw² and w². None when no parameter was scanned (‖w‖² = 0 and ‖Δw‖² = 0)."""
    if update_sum_sq < 0 or param_sum_sq < 0:
        raise ValueError("update_sum_sq and param_sum_sq must be >= 0")
    if update_sum_sq == 0 and param_sum_sq == 0:
        return None
    return math.sqrt(update_sum_sq) / (math.sqrt(param_sum_sq) + _scalar("eps", eps, positive=True))


def mean_max_violation(layers: Sequence[Sequence[float]]) -> float | None:
    """MaxVio averaged over the MoE layers that received a valid token (002 moe/maxvio.mean):
    each layer's max_i c_i / mean_i c_i - 1 (``expert_balance``), summed and divided by the
    number of such layers. None when no layer did (an empty layer is not a balanced one)."""
    found = [b.max_violation for b in map(expert_balance, layers) if b is not None]
    return math.fsum(found) / len(found) if found else None


def dead_expert_ratio(layers: Sequence[Sequence[float]]) -> float | None:
    """Experts with no valid token over all experts, counted over the MoE layers that
    received a valid token (002 moe/dead_expert_ratio). None when no layer did."""
    dead = total = 0
    for counts in layers:
        c = _counts("counts", counts)
        if c.sum() > 0:
            dead += int(np.count_nonzero(c == 0))
            total += c.size
    return dead / total if total else None


@dataclass(frozen=True, slots=True)
class Spread:
    """A per-tensor series over the tensors of a step: its least, median and largest value,
    and the tensors holding the least and the largest."""

    min: float
    min_at: str
    median: float
    max: float
    max_at: str


def spread(values: Mapping[str, float]) -> Spread | None:
    """Min (with its key), median and max (with its key) of the finite values; ties go to
    the first key in sorted order. None when no value is finite (none to describe). The
    median of an even count is the mean of the two middle values (``numpy.median``)."""
    finite = sorted((k, float(v)) for k, v in values.items() if math.isfinite(v))
    if not finite:
        return None
    lo = min(finite, key=lambda kv: kv[1])
    hi = max(finite, key=lambda kv: kv[1])
    return Spread(lo[1], lo[0], float(np.median([v for _, v in finite])), hi[1], hi[0])


def shares(counts: Mapping[str, float]) -> dict[str, float]:
    """Each key's share of the total, π^(μ) = N^(μ) / Σ_ν N^(ν) (seeds 001 §9 token share):
    {} when nothing was counted (no measurement, never a zero share)."""
    total = math.fsum(_counts("counts", list(counts.values()))) if counts else 0.0
    return {k: float(v) / total for k, v in sorted(counts.items())} if total > 0 else {}


def ratios_by_label(
    parts: Mapping[tuple[tuple[str, str], ...], float],
    wholes: Mapping[tuple[tuple[str, str], ...], float],
    key: str,
) -> dict[str, float]:
    """part / whole for each label set both hold, keyed by its ``key`` label (e.g. one
    agreement per MTP depth): ``ratio_from_components`` of each; a label set without a
    positive whole is left out."""
    out = {}
    for labels, whole in wholes.items():
        value = ratio_from_components(parts.get(labels), whole)
        if value is not None:
            out[dict(labels).get(key, "")] = value
    return dict(sorted(out.items()))


def memory_headroom(peaks: Mapping[int, float], capacities: Mapping[int, float]) -> float | None:
    """Headroom before the first out-of-memory failure (001 §5): min over ranks of
    1 - peak_r / capacity_r, over the ranks that sent a finite peak and a finite positive
    capacity (memory.capacity). None when no rank did."""
    found = [
        1.0 - peaks[r] / c
        for r, c in capacities.items()
        if r in peaks and math.isfinite(peaks[r]) and math.isfinite(c) and c > 0
    ]
    return min(found) if found else None
