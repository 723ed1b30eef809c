"""Retention policy: closed form against a NumPy mask, online policy against the closed form."""

from __future__ import annotations

import json

import numpy as np
import pytest

from probewire.stream.retention import RetentionPolicy, retained_steps

CONFIGS = [  # (k, halo, warmup_steps, final_steps)
    (10, 5, 3, 4),
    (7, 12, 0, 3),  # halo longer than the final window
    (25, 3, 10, 30),  # final window longer than the halo
    (1, 4, 0, 0),  # K = 1 keeps everything
    (50, 0, 0, 0),  # no halo: anomaly steps only
]


def reference_mask(n, anomalies, k, halo, warmup, final):
    s = np.arange(n)
    mask = (s % k == 0) | (s < warmup) | (s >= n - final)
    a = np.asarray(sorted(anomalies), dtype=np.int64)
    if a.size:
        mask |= (np.abs(s[:, None] - a[None, :]) <= halo).any(axis=1)
    return set(np.flatnonzero(mask).tolist())


def random_anomalies(rng, n):
    picks = set(rng.choice(n, size=int(rng.integers(0, 8)), replace=False).tolist())
    picks |= set(rng.choice([0, 1, 2, n - 3, n - 2, n - 1], size=2).tolist())  # near both ends
    start = int(rng.integers(5, n - 10))
    picks |= {start, start + int(rng.integers(1, 6))}  # two close anomalies: overlapping halos
    return picks


def run_policy(policy, steps, anomalies):
    """All releases, one list per call (offer for each step, then finish)."""
    batches = [policy.offer(s, {"step": s}, s in anomalies) for s in steps]
    return batches + [policy.finish()]


def check_release(batches, expected):
    for batch in batches:
        steps = [s for s, _ in batch]
        assert steps == sorted(steps)  # each call releases in step order
    released = [s for batch in batches for s, _ in batch]
    assert len(released) == len(set(released))  # each step at most once
    assert set(released) == expected
    assert all(payload == {"step": s} for batch in batches for s, payload in batch)


@pytest.mark.parametrize("config", CONFIGS)
def test_closed_form_matches_numpy_mask(config):
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(30, 200))
        anomalies = random_anomalies(rng, n)
        assert retained_steps(n, anomalies, *config) == reference_mask(n, anomalies, *config)


@pytest.mark.parametrize("config", CONFIGS)
def test_online_policy_matches_closed_form_on_random_anomalies(config):
    rng = np.random.default_rng(1)
    for _ in range(30):
        n = int(rng.integers(30, 300))
        anomalies = random_anomalies(rng, n)
        k, halo, warmup, final = config
        policy = RetentionPolicy(k=k, halo=halo, warmup_steps=warmup, final_steps=final)
        expected = retained_steps(n, anomalies, *config)
        check_release(run_policy(policy, range(n), anomalies), expected)


def test_worked_example():
    policy = RetentionPolicy(k=10, halo=2, warmup_steps=2, final_steps=3)
    batches = run_policy(policy, range(30), {15, 16})
    released = [s for batch in batches for s, _ in batch]
    assert released == [0, 1, 10, 13, 14, 15, 16, 17, 18, 20, 27, 28, 29]
    assert batches[15] == [(13, {"step": 13}), (14, {"step": 14}), (15, {"step": 15})]


def test_lookback_may_release_steps_older_than_an_earlier_release():
    policy = RetentionPolicy(k=10, halo=4)
    releases = [policy.offer(s, s, anomaly=s == 12) for s in range(7, 13)]
    assert releases == [[], [], [], [(10, 10)], [], [(8, 8), (9, 9), (11, 11), (12, 12)]]


def test_anomaly_releases_lookback_before_itself():
    policy = RetentionPolicy(k=100, halo=3)
    for s in range(1, 8):
        assert policy.offer(s, s, anomaly=False) == []
    assert policy.offer(8, 8, anomaly=True) == [(5, 5), (6, 6), (7, 7), (8, 8)]
    after = [policy.offer(s, s, anomaly=False) for s in (9, 10, 11, 12)]
    assert after == [[(9, 9)], [(10, 10)], [(11, 11)], []]


def test_buffer_stays_bounded_by_lookback():
    policy = RetentionPolicy(k=1000, halo=20, final_steps=5)
    for s in range(1, 500):
        policy.offer(s, [s], anomaly=False)
        assert len(policy.to_state()["buffer"]) <= policy.lookback == 20


def test_state_round_trip_mid_run_gives_identical_releases():
    rng = np.random.default_rng(2)
    n = 400
    anomalies = random_anomalies(rng, n)
    config = {"k": 50, "halo": 15, "warmup_steps": 5, "final_steps": 20}
    expected = run_policy(RetentionPolicy(**config), range(n), anomalies)
    for cut in (0, 1, 57, min(anomalies) + 3, 390, n):
        first = RetentionPolicy(**config)
        out = [first.offer(s, {"step": s}, s in anomalies) for s in range(cut)]
        restored = RetentionPolicy.from_state(json.loads(json.dumps(first.to_state())))
        out += run_policy(restored, range(cut, n), anomalies)
        assert out == expected


def test_gaps_in_steps_follow_step_numbers():
    rng = np.random.default_rng(3)
    for _ in range(30):
        n = int(rng.integers(50, 300))
        offered = sorted(set(rng.choice(n, size=n // 2, replace=False).tolist()) | {n - 1})
        anomalies = set(rng.choice(offered, size=3, replace=False).tolist())
        config = (9, 6, 4, 8)
        policy = RetentionPolicy(k=9, halo=6, warmup_steps=4, final_steps=8)
        expected = retained_steps(n, anomalies, *config) & set(offered)
        check_release(run_policy(policy, offered, anomalies), expected)


def test_a_step_at_or_below_the_newest_is_kept_at_once_and_changes_nothing_else():
    """After-gap and late steps are released as they come (the documented rule), never
    refused; the look-back buffer and the newest step stay as they were."""
    policy = RetentionPolicy(k=10, halo=2, final_steps=3)
    for step in (11, 12, 13):
        policy.offer(step, step, anomaly=False)
    before = policy.to_state()
    assert policy.offer(12, "again", anomaly=False) == [(12, "again")]
    assert policy.offer_late(5, "gap") == [(5, "gap")]
    assert policy.to_state() == before
    assert policy.finish() == [(11, 11), (12, 12), (13, 13)]


def test_finish_is_idempotent_and_a_later_step_reopens_the_run():
    policy = RetentionPolicy(k=5, final_steps=2)
    for step in (1, 2, 3):
        policy.offer(step, None, anomaly=False)
    assert [s for s, _ in policy.finish()] == [2, 3]
    assert policy.finish() == [] and policy.finished
    assert [s for s, _ in policy.offer(4, None, anomaly=False)] == []  # reopened: buffered
    assert not policy.finished
    assert [s for s, _ in policy.finish()] == [4]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"k": 0}, "k"),
        ({"k": 5, "halo": -1}, "halo"),
        ({"k": 5, "warmup_steps": -1}, "warmup_steps"),
        ({"k": 5, "final_steps": -2}, "final_steps"),
    ],
)
def test_config_errors_name_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        RetentionPolicy(**config)


def test_closed_form_rejects_anomaly_outside_run():
    with pytest.raises(ValueError, match="anomaly"):
        retained_steps(10, {10}, k=5)
