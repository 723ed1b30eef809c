"""The gross straggler tier (own-time ratio >= ``straggler_ratio`` x its baseline on
``straggler_steps`` steps) pages only when the job's step time is also at least
``straggler_job_slowdown`` x its own baseline on each of them (issue 38: a healthy 2-rank
run on a loaded host paged)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_straggler import item

from probewire.stream.signals import DetectorConfig, RankSeries, SignalDetectors
from probewire.stream.stage2 import RunPipeline, Stage2Config

RECORDED = json.loads((Path(__file__).parent / "data" / "gloo_2rank_steps.json").read_text())[
    "runs"
]
WINDOW = 50  # the detector window of the recording (benchmarks/detectors.py)


def recorded(run: str, until: int | None = None) -> list[tuple[int, float, dict[int, float]]]:
    """(step, step time, own-time ratios) of a recorded 2-rank run: the stored straggler
    rank's ratio, the other rank's its inverse (each is the other's whole reference)."""
    return [
        (step, tau, {rank: rho, 1 - rank: 1 / rho})
        for step, tau, rank, rho in RECORDED[run]
        if until is None or step <= until
    ]


def view(step_time: float | None) -> dict:
    return {
        "loss": None,
        "grad_norm": None,
        "ranks_missing": [],
        "loss_worst_rank": None,
        "step_time_s": step_time,
    }


def straggler_pages(
    det: SignalDetectors, steps: list[tuple[int, float | None, dict[int, float]]]
) -> list[tuple[int, str]]:
    """(step, culprit) of every paging straggler finding over (step, step time, ratios)."""
    out = []
    for step, tau, ratios in steps:
        _, found = det.observe(step, view(tau), {}, RankSeries(own_ratio=ratios))
        out += [(step, f.culprit) for f in found if f.kind == "straggler" and f.page]
    return out


def test_a_healthy_two_rank_run_whose_own_ratio_explodes_pages_nothing():
    """The recorded healthy 2-rank moe run: rank 1's own-time ratio held 18.7-20.8 on
    831-833 (the other rank's own time at the 5 % floor) while the job's step time was
    1.72x, 0.98x and 1.45x its median: no page; without the guard (the old rule) it pages
    at 833 naming rank 1, the page the healthy run sent."""
    series = recorded("healthy-moe")
    assert [s for s, _, r in series[831:834] if r[1] >= 18.7] == [831, 832, 833]
    assert straggler_pages(SignalDetectors(DetectorConfig(window=WINDOW)), series) == []
    unguarded = DetectorConfig(window=WINDOW, straggler_job_slowdown=0.0)
    assert straggler_pages(SignalDetectors(unguarded), series) == [(833, "rank 1")]


def test_the_guard_reads_the_step_time_over_the_median_of_its_window():
    """The ratio the guard holds is tau_t / exp(median of the previous ``window`` log step
    times), checked against NumPy at the false page's steps: under 1 at 832."""
    series = recorded("healthy-moe", until=833)
    det = SignalDetectors(DetectorConfig(window=WINDOW))
    straggler_pages(det, series)
    u = np.log(np.array([t for _, t, _ in series]) + det.spikes["step_time"].eps)
    want = [
        (series[i][0], float(np.exp(u[i] - np.median(u[i - WINDOW : i])))) for i in (831, 832, 833)
    ]
    got = list(det.stragglers.job)
    assert [s for s, _ in got] == [s for s, _ in want] == [831, 832, 833]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-12)
    assert [round(v, 2) for _, v in got] == [1.72, 0.98, 1.45]


def test_the_recorded_demo_straggler_pages_at_the_same_step_as_before():
    """The recorded 2-rank demo straggler (rank 1 sleeps 3 s a step from step 200 on ~50 ms
    steps; the job's step time 50-58x its median): paged at 202 naming rank 1, with and
    without the guard, and nothing before."""
    series = recorded("straggler")
    for slowdown in (DetectorConfig().straggler_job_slowdown, 0.0):
        cfg = DetectorConfig(window=WINDOW, straggler_job_slowdown=slowdown)
        got = straggler_pages(SignalDetectors(cfg), series)
        assert got and got[0] == (202, "rank 1") and all(200 <= s < 210 for s, _ in got)


@pytest.mark.parametrize(
    "job, paged",
    [
        ((1.5, 1.5, 1.5), [22]),  # the job slowed on each gross step: the third pages
        ((1.5, 1.0, 1.5), []),  # one step at its usual pace: host noise, not a straggler
        ((1.5, 1.5, 1.1), []),
        ((None, None, None), [22]),  # no step time measured: the own-time rule alone
    ],
)
def test_the_gross_tier_needs_the_job_slowed_on_each_of_its_steps(job, paged):
    rng = np.random.default_rng(1)
    cfg = DetectorConfig(
        window=10,
        straggler_cusum_h=1e9,
        straggler_ratio=3.0,
        straggler_held_ratio=1e9,
        straggler_recent_ratio=1e9,
        straggler_held_steps=8,
        straggler_recent_steps=8,
        rearm_steps=0,
    )
    warm = [
        (
            s,
            float(np.exp(rng.normal(0, 0.05))),
            {r: float(np.exp(rng.normal(0, 0.05))) for r in range(3)},
        )
        for s in range(20)
    ]
    slow = [(20 + i, None if j is None else j, {0: 1.0, 1: 4.0, 2: 1.0}) for i, j in enumerate(job)]
    got = straggler_pages(SignalDetectors(cfg), warm + slow)
    assert got == [(s, "rank 1") for s in paged]


def test_a_state_saved_before_the_guard_still_loads_and_pages():
    """A state without the guard's key (saved by the previous version) loads; its missing
    steps count as unmeasured, the guard holds from the next steps on."""
    cfg = DetectorConfig(window=WINDOW)
    series = recorded("healthy-moe")
    first = SignalDetectors(cfg)
    straggler_pages(first, series[:831])  # up to step 830
    state = json.loads(json.dumps(first.to_state()))
    assert len(state.pop("straggler_job")) == cfg.straggler_steps
    second = SignalDetectors.from_state(cfg, state)
    assert list(second.stragglers.job) == []
    assert straggler_pages(second, series[831:]) == []  # 832 measured the job at 0.98x
    round_trip = SignalDetectors.from_state(cfg, json.loads(json.dumps(first.to_state())))
    assert list(round_trip.stragglers.job) == list(first.stragglers.job)


# -- the demo's straggler fault through stage 2 --------------------------------------------------
def two_rank_job(compute_s: float, comm_s: float, extra_s: float, slowdown: float = 1.2):
    """Stage 2 on a synchronous 2-rank DDP job (window 50): rank 1's compute takes
    ``extra_s`` more on steps 120-129; the other rank waits for it in the all-reduce.
    Returns (the steps of the straggler findings, the first alert)."""
    rng = np.random.default_rng(120)
    config = Stage2Config(
        detectors=DetectorConfig(window=50, straggler_job_slowdown=slowdown),
        retention_every_k=10,
        retention_halo=5,
        warmup_steps=3,
        final_steps=4,
        max_wait_s=5,
        run_idle_s=30,
    )
    run, alerts, anomalies = RunPipeline("run", config), [], []
    for step in range(140):
        compute = compute_s * np.exp(rng.normal(0, 0.1, 2))
        if 120 <= step < 130:
            compute[1] += extra_s
        end = float(compute.max())
        taus = [end + comm_s + 0.001 * compute_s * float(rng.random()) for _ in range(2)]
        out = run.accept(
            item(step, taus, [{"ddp_allreduce": end - float(c) + comm_s} for c in compute]),
            now=step,
        )
        alerts += out.rows["alerts"]
        anomalies += out.rows["anomalies"]
    return [a["step"] for a in anomalies if a["kind"] == "straggler"], (alerts or [None])[0]


@pytest.mark.parametrize("delay_s", [3.0, 1.0])  # the fault's default; the gallery's
def test_the_demo_straggler_fault_pages_the_gross_tier_on_its_third_step(delay_s):
    """``deploy.demo.faults.Straggler``: rank 1 of 2 sleeps ``delay_s`` a step for 10 steps
    from step 120 on the demo's ~40 ms steps; the gross tier (the only straggler rule with
    two ranks) pages at 122 naming rank 1: the job's step time is ~25-75x its baseline."""
    gross, alert = two_rank_job(0.035, 0.005, delay_s)
    assert gross and gross[0] == 122 and all(120 <= s < 130 for s in gross)
    assert (alert["step"], alert["signal"], alert["culprit"]) == (122, "step_time", "rank 1")


def test_a_gross_straggler_whose_own_time_is_a_tenth_of_the_step_still_pages():
    """Communication-bound steps: own time 4 ms of 40 ms; rank 1's compute grows 5.5x, the
    step only ~1.45x (the guard's bound: 1 + (5 - 1) x its 10 % share): still paged at 122."""
    gross, alert = two_rank_job(0.004, 0.036, 4.5 * 0.004)
    assert gross and gross[0] == 122 and all(120 <= s < 130 for s in gross)
    assert (alert["step"], alert["culprit"]) == (122, "rank 1")
    # the guard is what it passed: asked for 1.5x, the same job's gross tier is silent
    assert two_rank_job(0.004, 0.036, 4.5 * 0.004, slowdown=1.5)[0] == []
