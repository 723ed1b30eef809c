"""The per-key CUSUM on log ratios to the peers (``stream.shifts.PeerShift``) against an
explicit float64 NumPy reference, and its behaviour on the shifts it is for."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from probewire.stream.shifts import PeerShift


def reference(steps, *, window, min_history, k, cap, h, min_scale, floor, joint_steps, delay=0):
    """Per step, per key: (ratio, baseline, scale, score, shift), recomputed from the explicit
    lists of each key's log values and deviations (no state but the lists and S); with
    ``delay`` d the history is the values before the key's last d."""
    hist: dict[int, list[float]] = {}
    devs: dict[int, list[float]] = {}
    score: dict[int, float] = {}
    out = []
    for ratios in steps:
        scored = {}
        for key, r in ratios.items():
            if not (np.isfinite(r) and r > 0):
                continue
            u = float(np.log(np.float64(r)))
            values = hist.get(key, [])
            past = np.array(values[: max(len(values) - delay, 0)][-window:], dtype=np.float64)
            if past.size >= min_history:
                b = float(np.median(past))
                if floor is not None:
                    b = max(b, math.log(floor))
                own = 1.4826 * float(np.median(np.abs(past - np.median(past))))
                devs.setdefault(key, []).append(u - b)
                scored[key] = (u, u - b, own)
            hist.setdefault(key, []).append(u)
        if len(scored) < 3:
            out.append({})
            continue
        row = {}
        for key, (u, x, own) in sorted(scored.items()):
            others = np.array(
                [max(d, 0.0) for j, ds in devs.items() if j != key for d in ds[-joint_steps:]],
                dtype=np.float64,
            )
            joint = float(np.sqrt(np.mean(others**2))) if others.size else 0.0
            scale = max(min_scale, own, joint)
            s = 0.0 if x <= 0 else max(0.0, score.get(key, 0.0) + min(x / scale, cap) - k)
            row[key] = (math.exp(u), math.exp(u - x), scale, s, s >= h)
            score[key] = 0.0 if s >= h else s
        out.append(row)
    return out


PARAMS = dict(
    window=30, min_history=5, k=2.0, cap=4.0, h=16.0, min_scale=0.05, floor=1.0, joint_steps=4
)


def series(seed: int, n: int = 90, ranks: int = 4) -> list[dict[int, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for t in range(n):
        ratios = {r: float(np.exp(rng.normal(0.02 * r, 0.04))) for r in range(ranks)}
        if 40 <= t < 60:
            ratios[2] *= 1.3
        if t % 11 == 0:
            del ratios[3]  # a gap
        if t == 70:
            ratios[1] = math.nan  # not a measurement
        out.append(ratios)
    return out


@pytest.mark.parametrize(("floor", "delay"), [(1.0, 0), (None, 0), (1.0, 7)])
def test_scores_match_a_float64_reference_through_a_state_round_trip(floor, delay):
    params = {**PARAMS, "floor": floor, "delay": delay}
    steps = series(3)
    want = reference(steps, **params)
    shift = PeerShift(**params)
    for t, ratios in enumerate(steps):
        if t == 50:  # a worker restart: the state is all it keeps
            shift = PeerShift.from_state(json.loads(json.dumps(shift.to_state())))
        got = {
            r.key: (r.ratio, r.baseline, r.scale, r.score, r.shift) for r in shift.update(ratios)
        }
        assert got.keys() == want[t].keys(), t
        for key, values in got.items():
            assert values[:4] == pytest.approx(want[t][key][:4], rel=1e-12, abs=1e-12), (t, key)
            assert values[4] == want[t][key][4]


def test_a_rank_moved_13_percent_pages_on_its_8th_step_naming_it_and_is_reset():
    steps = series(4)
    shift = PeerShift(**PARAMS)
    found = [(t, r.key) for t, ratios in enumerate(steps) for r in shift.update(ratios) if r.shift]
    assert found and {key for _, key in found} == {2}
    # 1.3x on a quiet key gains min(d / s, 4) - 2 = 2 a step (less on a noisy one): h = 16
    assert 47 <= found[0][0] <= 49
    assert all(t < 60 for t, _ in found)  # reset after each page; silent once it recovers


def test_bursts_the_ranks_share_widen_the_scale_and_a_step_at_parity_resets():
    rng = np.random.default_rng(5)
    steps = [{r: float(np.exp(rng.normal(0, 0.03))) for r in range(4)} for _ in range(30)]
    for _ in range(60):  # a loaded host: every rank slowed 2x on a third of its steps
        steps.append(
            {
                r: float(np.exp(rng.normal(0, 0.03))) * (2.0 if rng.random() < 0.33 else 1.0)
                for r in range(4)
            }
        )
    shift = PeerShift(**PARAMS)
    assert not any(r.shift for ratios in steps for r in shift.update(ratios))
    # one rank 2x on 7 steps, then one step at parity, then 7 more: never 8 in a row
    quiet = [{r: 1.0 for r in range(4)}] * 30
    slow = [{0: 1.0, 1: 2.0, 2: 1.0, 3: 1.0}] * 7
    shift = PeerShift(**PARAMS)
    assert not any(
        r.shift for ratios in quiet + slow + quiet[:1] + slow for r in shift.update(ratios)
    )


def test_two_keys_are_never_scored():
    shift = PeerShift(**PARAMS)
    assert all(shift.update({0: 1.0, 1: 3.0 if t > 20 else 1.0}) == [] for t in range(40))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"cap": 2.0}, "cap"),
        ({"h": 0.0}, "h must"),
        ({"min_history": 2}, "min_history"),
        ({"joint_steps": 0}, "joint_steps"),
    ],
)
def test_configuration_errors_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        PeerShift(**{**PARAMS, **kw})


def test_a_delayed_history_keeps_a_shift_that_stays_against_the_baseline_before_it():
    """A key 15% up from step 40 for good: with its values joining its history at once, the
    shift widens its own spread and moves its baseline and the CUSUM stalls; with a delay of
    20 steps it is scored against the level and spread from before it and pages."""
    rng = np.random.default_rng(5)
    steps = [
        {r: float(np.exp(rng.normal(0, 0.06))) * (1.15 if r == 2 and t >= 40 else 1.0)
         for r in range(4)}
        for t in range(100)
    ]  # fmt: skip
    params = {
        **PARAMS, "window": 50, "min_history": 20, "min_scale": 0.01, "floor": None, "k": 1.5,
        "h": 12.0,
    }  # fmt: skip

    def pages(delay):
        shift = PeerShift(**params, delay=delay)
        return [(t, r.key) for t, s in enumerate(steps) for r in shift.update(s) if r.shift]

    assert pages(0) == []
    got = pages(20)
    assert got and {k for _, k in got} == {2} and 40 <= got[0][0] < 60, got
