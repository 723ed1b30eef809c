"""Stage 2's rules of issue 38 on simulated ranks (``stream.testing.SimRun``) through stage 1's
reduction and stage 2 in process: a spike in a run's first steps, a 1.3x straggler, one
rank's loss shifted, the loop's gradient norm audited; and the same runs without the fault
page nothing. ``tests/integration/test_detector_pipeline.py`` runs them through the broker,
worker and store."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from probewire.stream.directions import DirectionalRules, norm_mismatch
from probewire.stream.findings import RankSeries
from probewire.stream.series import StepMetrics as SM
from probewire.stream.signals import DetectorConfig, SignalDetectors
from probewire.stream.stage2 import Stage2Config
from probewire.stream.testing import SimRun, stage2_in_process


def alerts_of(run: SimRun, window: int = 50, **detectors) -> list[tuple[int, str, str]]:
    config = Stage2Config(
        detectors=DetectorConfig(window=window, **detectors),
        retention_every_k=10,
        retention_halo=5,
        warmup_steps=5,
        final_steps=5,
    )
    alerts = stage2_in_process(run, config).get("alerts", [])
    return [(a["step"], a["signal"], a["culprit"]) for a in alerts]


BASE = SimRun(run_id="r", world_size=4, steps=100, seed=3, ddp=True)


def test_a_spike_at_step_20_pages_and_100_stable_steps_page_nothing():
    assert alerts_of(BASE) == []
    assert alerts_of(dataclasses.replace(BASE, cospike_step=20)) == [(20, "cospike", "")]
    # without the early regime the first 100 steps are not scored (window 100)
    assert (
        alerts_of(dataclasses.replace(BASE, cospike_step=20), window=100, early_history=100) == []
    )


def test_a_rank_13x_slower_for_20_steps_pages_within_20_steps_naming_it():
    slow = dataclasses.replace(BASE, steps=120, slow=(1, 60, 20, 1.3))
    got = alerts_of(slow)
    assert got and {(s, c) for s, c in ((a[1], a[2]) for a in got)} == {("step_time", "rank 1")}
    assert 60 <= got[0][0] < 80
    # the job's step-time spike out of reach: the CUSUM alone, on the 6th slow step
    # (min(x / s, 3) - 1 = 2 a step to h = 12)
    got = alerts_of(slow, signal_z=1e9)
    assert got[0] == (65, "step_time", "rank 1"), got


def test_a_host_wide_bursty_load_pages_nothing():
    assert alerts_of(dataclasses.replace(BASE, steps=200, burner=True)) == []


def test_one_ranks_loss_shifted_pages_within_20_steps_naming_it():
    shifted = dataclasses.replace(BASE, steps=120, shift=(2, 60, 1.1))
    got = alerts_of(shifted)
    assert got and got[0][1:] == ("loss_rank_shift", "rank 2") and 60 <= got[0][0] < 80
    assert {a[1:] for a in got} == {("loss_rank_shift", "rank 2")}


def test_the_audit_pages_a_loop_that_norms_its_local_shard_and_not_a_global_norm():
    local = alerts_of(dataclasses.replace(BASE, steps=30, clip_norm="local"))
    assert local[0] == (0, "grad_norm_audit", "the loop's gradient norm")
    assert alerts_of(dataclasses.replace(BASE, steps=30, clip_norm="global")) == []


@pytest.mark.parametrize(
    ("reported", "measured"),
    [(0.5, 0.5), (0.25, 0.5), (1.0, 0.7071), (0.0, 0.0), (1e-3, 0.0), (None, 1.0), (math.nan, 1.0)],
)
def test_norm_mismatch_matches_numpy(reported, measured):
    got = norm_mismatch(reported, measured)
    if reported is None or not np.isfinite(reported):
        assert got is None
    elif measured == 0.0:
        assert got == (0.0 if reported == 0.0 else math.inf)
    else:
        want = float(np.abs(np.float64(reported) - measured) / np.abs(np.float64(measured)))
        assert got == pytest.approx(want, rel=1e-15)


def test_the_audit_message_carries_both_values():
    det = SignalDetectors(DetectorConfig(window=10))
    view = {
        "loss": None,
        "grad_norm": 0.5,
        "grad_clip_norm": 0.25,
        "ranks_missing": [],
        "loss_worst_rank": None,
        "step_time_s": None,
    }
    _, findings = det.observe(0, view, {})
    (audit,) = [f for f in findings if f.signal == "grad_norm_audit"]
    assert (audit.value, audit.baseline, audit.page) == (0.25, 0.5, True)


def test_a_branch_overwriting_the_stream_a_collapsing_group_and_a_bpb_rise_page_their_part():
    """Through stage 1 and stage 2 in process: the simulated ranks' residual branches, gradient
    groups and held-out BPB evaluations (every 50 steps), healthy (factor 1) and faulty."""
    run = dataclasses.replace(BASE, steps=600, residual=(0, 1.0), vanish=(0, 1.0), bpb=(0, 1.0))
    assert alerts_of(run) == []
    faults = {
        "residual": ((300, 200.0), (300, "residual_scale", "layer 1 mlp")),
        "vanish": ((300, 1e-5), (302, "vanishing_gradients", "group other")),
        "bpb": ((400, 1.1), (400, "heldout_bpb", "suite heldout")),
    }
    for knob, (value, first) in faults.items():
        got = alerts_of(dataclasses.replace(run, **{knob: value}))
        assert got and got[0] == first and {g[1:] for g in got} == {first[1:]}, (knob, got)


RANK_LOSSES = json.loads((Path(__file__).parent / "data" / "gloo_rank_losses.json").read_text())


def recorded_shift_pages(run: str) -> list[tuple[int, str]]:
    """loss_rank_shift pages (step, culprit) of the default rules (window 50) on the recorded
    per-rank losses of 4 gloo DDP ranks."""
    rules, out = DirectionalRules(DetectorConfig(window=50)), []
    for step, losses in RANK_LOSSES["runs"][run]:
        series = RankSeries(loss={int(r): v for r, v in losses.items()})
        found = rules.observe({SM.grad_norm: None}, {}, series, warm=True)
        out += [(step, f.culprit) for f in found if f.signal == "loss_rank_shift"]
    return out


@pytest.mark.parametrize(("run", "first"), [("label-shuffle", 125), ("label-shuffle-half", 134)])
def test_a_recorded_ranks_shuffled_labels_page_loss_rank_shift_within_20_steps(run, first):
    """Rank 2's labels shuffled from step 120 (all its rows: its loss ~+25 %; half of them:
    ~+12 %, on the steps that drew them), 4 real gloo ranks of the demo whose per-rank loss
    moves ~5 % a step: paged on the 6th and the 15th shuffled step, naming rank 2, nothing
    before. Without the history's delay (``loss_shift_delay`` 0) the shifted values widen
    the rank's own spread within a few steps and the CUSUM stalls below h: the half run is
    not paged (and with the previous k 2, h 16 neither run was)."""
    got = recorded_shift_pages(run)
    assert got and got[0] == (first, "rank 2") and {c for _, c in got} == {"rank 2"}, got
    assert all(s >= 120 for s, _ in got)
