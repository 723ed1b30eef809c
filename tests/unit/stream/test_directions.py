"""The directional rules of issue 38 (``stream.directions``): each fires on its fault in its
direction, names what moved, its baseline and its culprit, stays silent on a stable series
and on the other direction, survives a state round trip, and has its stage in explain's
escalation order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from probewire.deploy.explain.model import STAGES
from probewire.deploy.explain.score import PAGE_FINDINGS
from probewire.stream.directions import DirectionalRules, History
from probewire.stream.findings import DetectorConfig, RankSeries
from probewire.stream.series import StepMetrics as SM

CFG = DetectorConfig(window=30, shift_history=10, clip_window=20, maxvio_steps=3, straggler_steps=3)


def quiet(rng: np.random.Generator) -> dict:
    return {
        SM.grad_norm: float(np.exp(rng.normal(0, 0.05))),
        SM.compute_rate: 1e12 * float(np.exp(rng.normal(0, 0.02))),
        SM.moe_shard_imbalance: 1.1 + 0.02 * float(rng.normal()),
        SM.moe_h_norm: 0.95 + 0.01 * float(rng.normal()),
        SM.modality_token_share: {"image": 0.3 + 0.01 * float(rng.normal())},
        SM.media_scale: 1.0,
        SM.memory_headroom: 0.4,
        SM.peak_memory_rank: 2,
        # per part (RankSeries): each branch's R_b, each gradient group's G_max
        "branch_ratio": {"layer 0 attn": 0.5, "layer 1 mlp": 20.0 * float(rng.uniform(0.8, 1))},
        "group_grad_max": {"embedding": 1e-3 * float(np.exp(rng.normal(0, 0.3))), "other": 0.02},
    }


def run(fault=None, steps: int = 80, start: int = 50, clip=None, restart: int | None = None):
    """(step, signal, kind, value, baseline, culprit) of every finding; ``fault(view)``
    edits the view from ``start`` on; ``clip(step)`` the derived clip rate."""
    rng = np.random.default_rng(1)
    rules, out = DirectionalRules(CFG), []
    for step in range(steps):
        if step == restart:
            rules = DirectionalRules.from_state(CFG, json.loads(json.dumps(rules.to_state())))
        view = quiet(rng)
        if fault is not None and step >= start:
            fault(view)
        derived = {SM.clip_rate: None if clip is None else clip(step)}
        parts = RankSeries(
            branch_ratio=view.pop("branch_ratio"), group_grad_max=view.pop("group_grad_max")
        )
        for f in rules.observe(view, derived, parts, warm=step >= 20):
            assert PAGE_FINDINGS[f.signal][0] == STAGES[f.category], f.signal
            out.append((step, f.signal, f.kind, f.value, f.baseline, f.culprit))
    return out


def test_a_stable_run_and_a_state_round_trip_find_nothing():
    assert run() == []
    assert run(restart=40) == []


def _set(name, value):
    return lambda v: v.__setitem__(name, value)


@pytest.mark.parametrize(
    ("fault", "signal", "kind", "culprit"),
    [
        (_set(SM.compute_rate, 0.6e12), SM.compute_rate, "drop", ""),
        (_set(SM.moe_shard_imbalance, 2.0), SM.moe_shard_imbalance, "threshold", ""),
        (_set(SM.moe_h_norm, 0.7), SM.moe_h_norm, "drop", ""),
        (
            _set(SM.modality_token_share, {"image": 0.1}),
            SM.modality_token_share,
            "shift",
            "modality image",
        ),
        (
            _set(SM.modality_token_share, {"image": 0.5}),
            SM.modality_token_share,
            "shift",
            "modality image",
        ),
        (_set(SM.media_scale, 300.0), SM.media_scale, "threshold", "media projector"),
        (_set(SM.grad_norm, 1e-5), "vanishing_gradients", "drop", ""),
        (
            _set("group_grad_max", {"embedding": 1e-3, "other": 1e-6}),
            "vanishing_gradients",
            "drop",
            "group other",
        ),
        (
            _set("branch_ratio", {"layer 0 attn": 0.5, "layer 1 mlp": 300.0}),
            "residual_scale",
            "threshold",
            "layer 1 mlp",
        ),
        (_set(SM.memory_headroom, 0.02), SM.memory_headroom, "threshold", "rank 2"),
    ],
)
def test_each_rule_fires_on_its_fault_in_its_direction_naming_it(fault, signal, kind, culprit):
    got = run(fault)
    assert got and {(g[1], g[2], g[5]) for g in got} == {(signal, kind, culprit)}
    first = got[0]
    held = 1 if kind == "threshold" and signal != SM.moe_shard_imbalance else 3
    if culprit == "group other":
        assert first[3:5] == (1e-6, 0.02)  # its G_max against its own baseline
    assert first[0] == 50 + held - 1, got[:3]  # a held rule: on its 3rd step
    assert first[4] is not None  # a baseline: the bound, or the signal's own history


@pytest.mark.parametrize(
    "fault",
    [
        _set(SM.compute_rate, 1.5e12),  # faster: not a drop
        _set(SM.moe_h_norm, 1.0),  # more uniform routing
        _set(SM.media_scale, 0.5),  # the small side is signals' rule
        _set(SM.grad_norm, 0.5),  # halved, not vanished
        _set("group_grad_max", {"embedding": 5e-4, "other": 0.01}),  # halved
        _set("group_grad_max", {"embedding": 1e-3}),  # a group not measured: no value
        _set("branch_ratio", {"layer 0 attn": 0.5, "layer 1 mlp": 60.0}),  # below the bound
        _set("branch_ratio", {"layer 0 attn": 1e-4}),  # small: signals' rule
        _set(SM.memory_headroom, 0.2),
    ],
)
def test_the_other_direction_or_a_small_move_finds_nothing(fault):
    assert run(fault) == []


def test_the_clip_rate_rule_waits_for_a_full_window_and_pages_a_rise_over_its_baseline():
    # 10% of steps clipped, then 50% from step 50: a rise of 0.4 over its baseline
    got = run(clip=lambda t: 0.1 if t < 50 else 0.5)
    assert got[0][:3] == (50, SM.clip_rate, "drift") and got[0][4] == pytest.approx(0.1)
    # a high rate while the window fills (steps < clip_window) is not scored
    assert run(clip=lambda t: 1.0 if t < 15 else 0.1) == []
    # nor while G2 is non-finite (NaN counts as clipped; the non-finite G2 pages itself)
    nan = run(_set(SM.grad_norm, float("nan")), clip=lambda t: 0.1 if t < 50 else 0.5)
    assert [f for f in nan if f[1] == SM.clip_rate] == []


def test_history_baseline_is_the_numpy_median_of_the_last_window_values():
    rng = np.random.default_rng(2)
    values = list(rng.normal(size=50))
    history = History(12)
    for i, v in enumerate(values):
        want = np.median(values[max(0, i - 12) : i]) if i >= 5 else None
        got = history.baseline(5)
        assert (got is None) == (want is None)
        if want is not None:
            assert got == float(want)
        history.add(v)


def test_gradients_that_went_non_finite_are_not_a_vanishing_page():
    """G2 NaN at step 50 (its own page), then the groups' G_max near zero for a few steps
    (a loop that zeroes or skips non-finite gradients): no vanishing page within
    ``straggler_steps`` of it; a collapse that lasts past that window still pages."""

    def fault(view, until):
        def edit(v):
            if v["step"] == 50:
                v[SM.grad_norm] = float("nan")
            v["group_grad_max"] = (
                {g: 1e-9 for g in v["group_grad_max"]} if v["step"] < until else v["group_grad_max"]
            )

        return edit

    def steps(until: int) -> list:
        rng = np.random.default_rng(1)
        rules, found = DirectionalRules(CFG), []
        for step in range(70):
            view = quiet(rng) | {"step": step}
            if step >= 50:
                fault(view, until)(view)
            parts = RankSeries(
                branch_ratio=view.pop("branch_ratio"), group_grad_max=view.pop("group_grad_max")
            )
            view.pop("step")
            found += [
                (step, f.signal)
                for f in rules.observe(view, {SM.clip_rate: None}, parts, warm=True)
            ]
        return [s for s, signal in found if signal == "vanishing_gradients"]

    assert steps(until=53) == []  # zeroed gradients within 3 steps of the NaN
    assert steps(until=70) and min(steps(until=70)) >= 50 + CFG.straggler_steps
