"""The straggler: stage 2 names it by its own time (step time minus its exposed collective
wait), and `step_time` pages when the same rank stays ahead by a ratio for a few steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from probewire.stream.assemble import reduce_step
from probewire.instrument.wire import RankStep, series_key
from probewire.stream.signals import DetectorConfig, SignalDetectors
from probewire.stream.stage2 import RunPipeline, Stage2Config, p0_view


def item(step: int, taus: list[float], waits: list[dict[str, float]]):
    """One reduced step: rank r's step time taus[r] and its comm.wait_s by op waits[r]."""
    out = []
    for r, (tau, by_op) in enumerate(zip(taus, waits)):
        values = {series_key("loss.sum"): 10.0, series_key("loss.tokens"): 5.0,
                  series_key("grad.norm_sq"): 1.0, series_key("step_time_s"): tau}
        values.update({series_key("comm.wait_s", {"op": op}): w for op, w in by_op.items()})
        out.append(RankStep(run_id="run", step=step, rank=r, world_size=len(taus), host="h",
                            coords={"dp": r}, values=values))
    return reduce_step("run", step, len(taus), out, "all_ranks")


def reference(taus: list[float], waits: list[dict[str, float]]) -> tuple[int, float | None]:
    tau = np.asarray(taus, dtype=np.float64)
    wait = np.array([sum(w.values()) for w in waits], dtype=np.float64)
    own = np.maximum(tau - wait, 0.0)
    k = int(np.argmax(own))
    others = np.delete(own, k)
    return k, (float(own[k] / (np.median(others) + 1e-12)) if others.size else None)


def test_the_straggler_is_the_largest_own_time_not_the_largest_step_time():
    # synchronous DDP: rank 2 is slow, the others wait for it in the all-reduce, so every
    # step time carries its delay (rank 0's is the largest); rank 3 reports no wait (its
    # own time is its step time), rank 1 waits on two ops
    taus = [3.31, 3.29, 3.30, 0.45]
    waits = [{"ddp_allreduce": 2.95}, {"ddp_allreduce": 2.70, "all_reduce": 0.21},
             {"ddp_allreduce": 0.02}, {}]
    view, _ = p0_view(item(7, taus, waits))
    rank, score = reference(taus, waits)
    assert int(np.argmax(taus)) == 0 and rank == 2
    assert view["straggler_rank"] == 2
    assert view["straggler_own_ratio"] == pytest.approx(score, rel=1e-12)
    assert view["step_time_s"] == 3.31  # tau = max over ranks, as before
    # the seeds' S = tau / median tau_r: ~1 when the others wait for the straggler
    assert view["straggler_score"] == pytest.approx(3.31 / np.median(taus), rel=1e-7)


@pytest.mark.parametrize("taus, waits", [
    ([0.30, 3.30], [{"ddp_allreduce": 0.01}, {"ddp_allreduce": 0.02}]),   # R=2: max / min
    ([3.30, 3.31], [{"ddp_allreduce": 0.01}, {"ddp_allreduce": 3.00}]),
    ([0.2, 0.5, 0.3], [{}, {}, {}]),                                       # no wait at all
    ([0.25, 0.21, 0.22, 0.24, 0.9], [{"ddp_allreduce": 0.01}] * 4 + [{}]),
])
def test_straggler_rank_and_score_match_a_float64_reference(taus, waits):
    view, _ = p0_view(item(3, taus, waits))
    rank, score = reference(taus, waits)
    assert view["straggler_rank"] == rank
    assert view["straggler_own_ratio"] == pytest.approx(score, rel=1e-12)
    assert view["straggler_score"] == pytest.approx(max(taus) / np.median(taus), rel=1e-7)
    if len(taus) == 2:
        own = np.asarray(taus) - [sum(w.values()) for w in waits]
        assert view["straggler_own_ratio"] == pytest.approx(own.max() / own.min(), rel=1e-10)


def test_a_single_rank_is_its_own_straggler_with_no_score():
    view, _ = p0_view(item(0, [0.4], [{"ddp_allreduce": 0.1}]))
    assert view["straggler_rank"] == 0 and view["straggler_own_ratio"] is None


def view(rank: int | None, score: float | None) -> dict:
    """The P0 view fields the straggler rule reads (no loss, no step-time spike rule)."""
    return {"loss": None, "grad_norm": None, "ranks_missing": [], "loss_worst_rank": None,
            "step_time_s": None, "straggler_rank": rank, "straggler_own_ratio": score}


def straggler_pages(det: SignalDetectors, steps: list[tuple[int, int | None, float | None]]):
    out = []
    for step, rank, score in steps:
        _, findings = det.observe(step, view(rank, score), {})
        out += [(step, f.culprit, f.value) for f in findings
                if f.signal == "step_time" and f.kind == "straggler"]
    return out


# rearm 0: every finding passes the once-per-episode gate, so the rule itself shows
CFG = DetectorConfig(straggler_ratio=2.0, straggler_steps=3, rearm_steps=0)


def test_the_rule_fires_on_the_kth_consecutive_step_of_the_same_rank_not_before():
    det = SignalDetectors(CFG)
    got = straggler_pages(det, [(0, 1, 1.2), (1, 1, 2.5), (2, 1, 2.0), (3, 1, 7.0),
                                (4, 1, 6.0), (5, 1, 1.9), (6, 1, 3.0)])
    assert got == [(3, "rank 1", 7.0), (4, "rank 1", 6.0)]  # steps 1-3: the third at 3


def test_a_different_rank_a_quiet_step_or_a_gap_resets_the_run():
    det = SignalDetectors(CFG)
    got = straggler_pages(det, [(0, 1, 3.0), (1, 1, 3.0), (2, 0, 3.0), (3, 1, 3.0),
                                (4, 1, 3.0), (5, None, None), (6, 1, 3.0), (7, 1, 3.0),
                                (9, 1, 3.0), (10, 1, 3.0), (11, 1, 3.0)])
    assert got == [(11, "rank 1", 3.0)]


def test_the_page_is_one_step_time_alert_per_episode():
    det = SignalDetectors(DetectorConfig(straggler_ratio=2.0, straggler_steps=2, rearm_steps=5))
    pages = []
    for step in range(12):
        _, findings = det.observe(step, view(1, 4.0 if step < 6 else 1.0), {})
        pages += [(step, f.culprit) for f in findings if f.page]
    assert pages == [(1, "rank 1")]


def test_the_run_survives_a_state_round_trip():
    steps = [(10, 1, 2.5), (11, 1, 2.6), (12, 1, 2.7), (13, 1, 2.8)]
    straight = straggler_pages(SignalDetectors(CFG), steps)
    first = SignalDetectors(CFG)
    assert straggler_pages(first, steps[:2]) == []
    state = json.loads(json.dumps(first.to_state()))  # what ClickHouse holds
    second = SignalDetectors.from_state(CFG, state)
    assert straggler_pages(second, steps[2:]) == straight == [(12, "rank 1", 2.7),
                                                              (13, "rank 1", 2.8)]
    older = {k: v for k, v in state.items() if k != "straggler_run"}  # a state from before
    assert straggler_pages(SignalDetectors.from_state(CFG, older), steps[2:3]) == []


def run_steps(config: Stage2Config, n: int, slow_from: int, slow_for: int):
    """Two DDP ranks; from ``slow_from`` rank 1 sleeps 3 s, rank 0 waits it out in the
    all-reduce, so rank 0's step time is the larger one on every slow step."""
    rng = np.random.default_rng(11)
    run, rows = RunPipeline("run", config), {"alerts": [], "anomalies": [], "step_metrics": []}
    for step in range(n):
        compute = 0.1 * np.exp(rng.normal(0, 0.2, 2))
        wait = 0.01 * np.exp(rng.normal(0, 0.3, 2))
        taus, waits = list(compute + wait), list(wait)
        if slow_from <= step < slow_from + slow_for:
            taus = [3.0 + compute[1] + 0.02, 3.0 + compute[1] + 0.01]
            waits = [3.0 + compute[1] - compute[0] + 0.02, wait[1]]
        out = run.accept(item(step, taus, [{"ddp_allreduce": w} for w in waits]), now=step)
        for table in rows:
            rows[table] += out.rows[table]
    return rows


def small(**kw) -> Stage2Config:
    return Stage2Config(detectors=DetectorConfig(window=20, **kw), retention_every_k=10,
                        retention_halo=5, warmup_steps=3, final_steps=4, max_wait_s=5,
                        run_idle_s=30)


def test_a_ddp_straggler_pages_step_time_naming_the_slow_rank():
    rows = run_steps(small(), 40, 30, 6)
    assert [r["straggler_rank"] for r in rows["step_metrics"][30:36]] == [1] * 6
    assert all(r["straggler_own_ratio"] > 10 for r in rows["step_metrics"][30:36])
    assert [(a["step"], a["signal"], a["culprit"]) for a in rows["alerts"]] == \
        [(30, "step_time", "rank 1")]  # the spike rule on a quiet host, on the first step
    # the spike rule out of reach (a noisy host): the straggler rule pages on the 3rd step
    rows = run_steps(small(signal_z=1e9), 40, 30, 6)
    assert [(a["step"], a["signal"], a["culprit"]) for a in rows["alerts"]] == \
        [(32, "step_time", "rank 1")]
    kinds = [(a["step"], a["kind"]) for a in rows["anomalies"] if a["signal"] == "step_time"]
    assert kinds == [(32, "straggler")]  # one page per episode: the rest of it is gated


def test_the_thresholds_come_from_the_settings_tree():
    from probewire.deploy.settings import load_settings

    defaults = load_settings(env={}).stream.stage2.detectors
    assert (defaults.straggler_ratio, defaults.straggler_steps) == \
        (DetectorConfig().straggler_ratio, DetectorConfig().straggler_steps)
    tuned = load_settings(env={"PROBEWIRE_STREAM__STAGE2__DETECTORS__STRAGGLER_RATIO": "2.5",
                               "PROBEWIRE_STREAM__STAGE2__DETECTORS__STRAGGLER_STEPS": "5"}
                          ).stream.stage2.detectors
    assert (tuned.straggler_ratio, tuned.straggler_steps) == (2.5, 5)
