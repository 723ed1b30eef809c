"""Cross-rank reductions and derived series against float64 NumPy references (the functions
stage 2's view calls for every step; ``test_view_calls_derive`` ties the two together)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probewire.stream import derive
from probewire.stream.derive import (
    compute_rate,
    expert_balance,
    global_mean_loss,
    loss_by_group,
    mean_from_components,
    media_scale,
    norm_from_squares,
    rms_from_components,
    shard_imbalance,
    straggler_score,
    token_rate,
    worst_rank_loss,
)


def rank_tokens(sizes, seed):
    """Per-rank per-token NLL arrays; rank r has a different loss level."""
    rng = np.random.default_rng(seed)
    return [rng.gamma(2.0, 1.0 + 0.5 * r, size=n) for r, n in enumerate(sizes)]


def components(tokens):
    return [float(np.sum(t)) for t in tokens], [float(t.size) for t in tokens]


def test_global_mean_loss_weights_by_tokens_not_ranks():
    tokens = rank_tokens([3000, 40, 700, 5], seed=0)
    sums, counts = components(tokens)
    expected = np.concatenate(tokens).mean()
    naive = np.mean([t.mean() for t in tokens])
    assert abs(naive - expected) > 0.5  # uneven counts: the mean of rank means is wrong
    assert global_mean_loss(sums, counts) == pytest.approx(expected, rel=1e-12)


def test_rank_with_zero_tokens_is_skipped():
    tokens = rank_tokens([500, 0, 80], seed=1)
    sums, counts = components(tokens)
    assert counts[1] == 0.0
    everything = np.concatenate(tokens)
    assert global_mean_loss(sums, counts) == pytest.approx(everything.mean(), rel=1e-12)
    means = {r: t.mean() for r, t in enumerate(tokens) if t.size}
    worst_rank = max(means, key=means.get)
    value, rank = worst_rank_loss(sums, counts)
    assert rank == worst_rank == 2
    assert value == pytest.approx(means[2], rel=1e-12)


def test_worst_rank_never_reports_an_empty_rank_as_zero():
    # every real rank has a negative mean here, so a zero from the empty rank would win
    value, rank = worst_rank_loss([-9.0, 0.0, -2.0], [3.0, 0.0, 1.0])
    assert (value, rank) == (-2.0, 2)


def test_worst_rank_ties_go_to_lowest_rank_and_nan_is_worst():
    assert worst_rank_loss([4.0, 2.0, 4.0], [2.0, 1.0, 2.0]) == (2.0, 0)
    value, rank = worst_rank_loss([4.0, math.nan, 9.0], [2.0, 1.0, 1.0])
    assert math.isnan(value) and rank == 1


def test_all_ranks_empty_is_not_measured():
    assert global_mean_loss([0.0, 0.0], [0.0, 0.0]) is None
    assert worst_rank_loss([0.0, 0.0], [0.0, 0.0]) is None
    assert global_mean_loss([], []) is None
    assert loss_by_group({"web": [0.0]}, {"web": [0.0]}) == {}


@pytest.mark.parametrize(
    ("sums", "counts", "match"),
    [
        ([1.0], [1.0, 2.0], "ranks"),
        ([1.0], [-1.0], "token_counts"),
        ([1.0], [0.0], "loss_sums"),
        ([1.0], [math.nan], "token_counts"),
    ],
)
def test_malformed_loss_components_raise(sums, counts, match):
    with pytest.raises(ValueError, match=match):
        global_mean_loss(sums, counts)


def test_loss_by_group_against_pooled_tokens():
    rng = np.random.default_rng(2)
    groups = {  # per group, per rank token losses (uneven, one empty rank)
        "web": [rng.gamma(2.0, 1.0, n) for n in (900, 0, 650)],
        "code": [rng.gamma(2.0, 0.4, n) for n in (30, 12, 0)],
        "image": [rng.gamma(2.0, 2.0, n) for n in (0, 0, 0)],
    }
    sums = {g: [float(np.sum(t)) for t in ts] for g, ts in groups.items()}
    counts = {g: [float(t.size) for t in ts] for g, ts in groups.items()}
    got = loss_by_group(sums, counts)
    all_tokens = sum(t.size for ts in groups.values() for t in ts)
    assert set(got) == {"web", "code"}  # the empty group is left out, not zero
    for g in ("web", "code"):
        pooled = np.concatenate(groups[g])
        loss, share, n = got[g]
        assert loss == pytest.approx(pooled.mean(), rel=1e-12)
        assert share == pytest.approx(pooled.size / all_tokens, rel=1e-12)
        assert n == pooled.size
    assert got["code"][1] == pytest.approx(42 / 1592, rel=1e-12)
    assert sum(share for _, share, _ in got.values()) == pytest.approx(1.0)
    with_total = loss_by_group(sums, counts, total_tokens=3184.0)
    assert with_total["code"][1] == pytest.approx(42 / 3184, rel=1e-12)


def test_loss_by_group_without_total_tokens_has_no_share_and_rejects_mismatched_groups():
    [(loss, share, n)] = loss_by_group({"a": [3.0]}, {"a": [2.0]}, total_tokens=0.0).values()
    assert (loss, n) == (1.5, 2.0) and math.isnan(share)
    with pytest.raises(ValueError, match="same groups"):
        loss_by_group({"a": [1.0]}, {"b": [1.0]})


def test_throughput_and_compute_rate():
    rng = np.random.default_rng(8)
    tokens = rng.integers(0, 4096, 64).astype(np.float64)  # per rank
    times = rng.uniform(0.9, 1.3, 64)  # per rank, seconds
    tau = np.max(times)  # stage 1's reduction
    assert token_rate(float(tokens.sum()), float(tau)) == pytest.approx(
        tokens.sum() / tau, rel=1e-15
    )
    flops = np.float64(6.0e15)
    assert compute_rate(6.0e15, 64, float(tau)) == pytest.approx(flops / (64 * tau), rel=1e-15)
    # no time (no rank reported one, or 0 s) or no FLOP estimate: not measured
    assert token_rate(100, None) is None and token_rate(100, 0.0) is None
    assert compute_rate(None, 8, 1.0) is None and compute_rate(1.0, 8, 0.0) is None
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="tau"):
            token_rate(100, bad)
    with pytest.raises(ValueError, match="n_devices"):
        compute_rate(1.0, 0, 1.0)


def test_grad_norm_from_the_owners_squared_norms():
    rng = np.random.default_rng(9)
    shards = [rng.normal(0.0, 1e-3, n) for n in (1000, 0, 4321)]  # each owner's gradients
    norm_sq = sum(float(np.sum(g * g)) for g in shards)  # what stage 1 sums
    assert norm_from_squares(norm_sq) == pytest.approx(
        np.linalg.norm(np.concatenate(shards)), rel=1e-12
    )
    assert norm_from_squares(None) is None
    assert math.isnan(norm_from_squares(math.nan)) and math.isnan(norm_from_squares(-1.0))
    assert norm_from_squares(math.inf) == math.inf


def test_media_scale_against_embedding_rms():
    rng = np.random.default_rng(10)
    media = [rng.normal(0.0, 3.0, (n, 16)) for n in (40, 0, 25)]  # per rank, embeddings
    text = [rng.normal(0.0, 0.5, (n, 16)) for n in (300, 210, 0)]
    parts = [
        (float(sum(np.sum(e * e) for e in group)), float(sum(e.size for e in group)))
        for group in (media, text)
    ]
    rms = [np.sqrt(np.mean(np.concatenate(g) ** 2)) for g in (media, text)]
    assert media_scale(*parts[0], *parts[1]) == pytest.approx(rms[0] / (rms[1] + 1e-12), rel=1e-12)
    assert media_scale(None, 1.0, 1.0, 1.0) is None and media_scale(1.0, 0.0, 1.0, 1.0) is None
    assert math.isnan(media_scale(-1.0, 2.0, 1.0, 1.0))
    assert math.isnan(media_scale(math.nan, 2.0, 1.0, 1.0))


def test_straggler_score():
    times = np.array([1.02, 0.98, 1.00, 1.75])  # even count: median averages the middle two
    expected = np.max(times) / (np.median(times) + 1e-8)
    assert straggler_score(times) == pytest.approx(expected, rel=1e-14)
    assert straggler_score([1.0, 1.0, 1.0]) == pytest.approx(1.0, abs=1e-7)
    assert straggler_score([]) is None


def reference_balance(c):
    c = np.asarray(c, dtype=np.float64)
    p = c / c.sum()
    nz = p[p > 0]
    h = -np.sum(nz * np.log(nz))
    return c.max() / c.mean(), h, h / np.log(c.size), np.mean(c == 0)


def test_expert_balance_matches_reference():
    counts = np.random.default_rng(3).integers(0, 500, size=16).astype(float)
    counts[[2, 9]] = 0.0
    got = expert_balance(counts)
    imbalance, h, h_norm, dead = reference_balance(counts)
    assert got.n_experts == 16 and got.total_tokens == counts.sum()
    assert got.imbalance == pytest.approx(imbalance, rel=1e-12)
    assert got.max_violation == pytest.approx(imbalance - 1.0, rel=1e-12)
    assert got.entropy == pytest.approx(h, rel=1e-12)
    assert got.entropy_norm == pytest.approx(h_norm, rel=1e-12)
    assert got.dead_ratio == dead == 2 / 16


def test_expert_balance_extremes():
    uniform = expert_balance([250.0] * 8)
    assert (uniform.imbalance, uniform.max_violation, uniform.dead_ratio) == (1.0, 0.0, 0.0)
    assert uniform.entropy_norm == pytest.approx(1.0, rel=1e-12)
    collapsed = expert_balance([0.0, 0.0, 96.0, 0.0])
    assert (collapsed.imbalance, collapsed.entropy, collapsed.entropy_norm) == (4.0, 0.0, 0.0)
    assert collapsed.dead_ratio == 0.75
    assert expert_balance([1.0, 1.0, 1.25, 0.75]).max_violation == pytest.approx(0.25)


def test_single_expert_has_no_normalised_entropy():
    got = expert_balance([37.0])
    summary = (got.imbalance, got.max_violation, got.entropy, got.entropy_norm)
    assert summary == (1.0, 0.0, 0.0, None)


def test_empty_layer_is_not_a_measured_zero():
    assert expert_balance([0.0, 0.0, 0.0]) is None
    assert expert_balance([]) is None
    assert shard_imbalance([0.0, 0.0], [0, 1]) is None


def test_shard_imbalance_matches_reference():
    counts = np.array([100.0, 100.0, 100.0, 100.0, 10.0, 10.0, 300.0, 0.0])
    shard_of_expert = [0, 0, 1, 1, 2, 2, 3, 3]
    loads = np.zeros(4)
    for c, s in zip(counts, shard_of_expert):
        loads[s] += c
    expected = loads.max() / loads.mean()
    assert shard_imbalance(counts, shard_of_expert) == pytest.approx(expected, rel=1e-14)
    # balanced experts, unbalanced shards
    assert expert_balance([10.0] * 4).imbalance == 1.0
    assert shard_imbalance([10.0] * 4, [0, 0, 0, 1]) == pytest.approx(1.5)


@pytest.mark.parametrize("mapping", [[0, 2], [0], [0.0, 1.0], [-1, 0]])
def test_shard_mapping_must_cover_every_shard(mapping):
    with pytest.raises(ValueError, match="shard_of_expert"):
        shard_imbalance([1.0, 1.0], mapping)


def test_rms_and_mean_from_rank_components():
    rng = np.random.default_rng(4)
    shards = [rng.normal(0.3, 2.0, n) for n in (1000, 0, 17, 333)]
    everything = np.concatenate(shards)
    sum_sq = sum(float(np.sum(s * s)) for s in shards)
    total = sum(float(np.sum(s)) for s in shards)
    n = float(sum(s.size for s in shards))
    expected_rms = np.sqrt(np.mean(everything**2))
    assert rms_from_components(sum_sq, n) == pytest.approx(expected_rms, rel=1e-12)
    assert mean_from_components(total, n) == pytest.approx(np.mean(everything), rel=1e-12)
    assert rms_from_components(0.0, 0.0) is None and mean_from_components(0.0, 0) is None
    assert math.isnan(rms_from_components(math.nan, 4.0))
    with pytest.raises(ValueError, match="count"):
        rms_from_components(1.0, -1.0)


def _bits(found):
    """A result's exact bits (NaN payloads and the sign of zero included)."""
    if found is None or isinstance(found, float):
        return None if found is None else np.float64(found).tobytes()
    return np.float64(found[0]).tobytes(), found[1]


def test_few_ranks_loss_path_equals_numpys_bit_for_bit():
    """Few ranks' lists take the Python path (``_few_loss_components``: a sum of under 8,
    a worst rank of under 128); the same values as arrays take NumPy's: every result is the same, bit for bit, NaN, inf, -0.0, huge and
    tiny sums included, and so is each malformed input's error."""
    rng = np.random.default_rng(7)
    special = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e308, 5e-324, -1e300, 3.0]
    checked = 0
    for _ in range(2000):
        n = int(rng.integers(0, 8)) if rng.random() < 0.8 else int(rng.integers(8, 128))
        sums = [
            float(rng.choice(special)) if rng.random() < 0.3 else float(rng.normal(0, 10) ** 3)
            for _ in range(n)
        ]
        counts = [float(rng.choice([0.0, 1.0, 7.0, 1e17, 0.5])) for _ in range(n)]
        sums = [s if c else float(rng.choice([0.0, -0.0])) for s, c in zip(sums, counts)]
        for fn, few in ((derive.global_mean_loss, 8), (derive.worst_rank_loss, 128)):
            if n < few:
                assert derive._few_loss_components(sums, counts, few) is not None
            with np.errstate(all="ignore"):  # NumPy warns of the inf sums it returns
                reference = fn(np.array(sums), np.array(counts))
                assert _bits(fn(sums, counts)) == _bits(reference)
            checked += 1
    assert checked == 4000
    assert derive._few_loss_components([1.0] * 8, [1.0] * 8, 8) is None
    for sums, counts in ([1.0], [1.0, 2.0]), ([1.0], [-1.0]), ([1.0], [0.0]), ([1.0], [math.nan]):
        for fn in (derive.global_mean_loss, derive.worst_rank_loss):
            with pytest.raises(ValueError) as fast:
                fn(sums, counts)
            with pytest.raises(ValueError) as slow:
                fn(np.array(sums), np.array(counts))
            assert str(fast.value) == str(slow.value)
