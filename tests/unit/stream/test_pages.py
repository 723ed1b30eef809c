"""Pages a person can trust: every finding is recorded whatever the page gate decides, a
second event inside a page episode updates the page record, and the culprit rules page
on the culprit's own move (a rank's or a source's own loss against its own history)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from probewire.instrument.wire import RankStep, series_key
from probewire.stream.pages import PageGate
from probewire.stream.reduce import reduce_step
from probewire.stream.retention import retained_steps
from probewire.stream.signals import Category, DetectorConfig, Finding
from probewire.stream.stage2 import RunPipeline, Stage2Config


def records(step, per_rank, *, g2=1.0, sources=None):
    """One reduced step: per rank (loss sum, valid tokens), and by source on some ranks."""
    out = []
    for r, (loss_sum, n) in enumerate(per_rank):
        values = {
            series_key("loss.sum"): loss_sum,
            series_key("loss.tokens"): n,
            series_key("grad.norm_sq"): g2,
            series_key("step.duration"): 0.1,
        }
        for src, (s, c) in (sources or {}).get(r, {}).items():
            values[series_key("loss.sum", {"source": src})] = s
            values[series_key("loss.tokens", {"source": src})] = c
        out.append(
            RankStep(
                run_id="run",
                step=step,
                rank=r,
                world_size=len(per_rank),
                host="h",
                coords={"dp": r},
                values=values,
            )
        )
    return reduce_step("run", step, len(per_rank), out, "all_ranks")


def config(**kw) -> Stage2Config:
    return Stage2Config(
        detectors=DetectorConfig(window=20, rearm_steps=30, **kw),
        retention_every_k=10,
        retention_halo=5,
        warmup_steps=3,
        final_steps=4,
        max_wait_s=5,
        run_idle_s=30,
    )


def collect(run: RunPipeline, items) -> dict[str, list]:
    rows: dict[str, list] = {"alerts": [], "anomalies": [], "step_metrics": [], "promote": []}
    for i, item in enumerate(items):
        out = run.accept(item, now=i)
        for table in ("alerts", "anomalies", "step_metrics"):
            rows[table] += out.rows[table]
        rows["promote"] += out.promote
    rows["promote"] += run.finish().promote
    return rows


# -- the gate ---------------------------------------------------------------------------------
def finding(signal="cospike", culprit=""):
    return Finding(
        signal=signal,
        kind="spike",
        value=1.0,
        baseline=1.0,
        z=9.0,
        category=Category.GRAD,
        page=True,
        culprit=culprit,
    )


def test_the_gate_opens_an_episode_counts_new_events_and_rearms():
    gate = PageGate(rearm_steps=10)
    seen = []
    for step in (5, 6, 7, 12, 12, 30, 31):
        e = gate.admit(step, finding())
        seen.append((step, e.first_step, e.count, e.new_event))
    assert seen == [
        (5, 5, 1, True),  # a page
        (6, 5, 1, False),  # the same event continues (consecutive steps)
        (7, 5, 1, False),
        (12, 5, 2, True),  # a new event inside the episode: update the record
        (12, 5, 2, False),  # a second rule at the same step
        (30, 30, 1, True),  # 18 quiet steps > rearm 10: a new page
        (31, 30, 1, False),
    ]


def test_worst_rank_and_source_episodes_are_per_culprit():
    gate = PageGate(rearm_steps=10)
    assert gate.admit(1, finding("loss_worst_rank", "rank 1")).count == 1
    assert gate.admit(3, finding("loss_worst_rank", "rank 0")).count == 1  # a second page
    assert gate.admit(5, finding("loss_worst_rank", "rank 1")).count == 2
    assert gate.admit(6, finding("step_time", "rank 1")).count == 1
    assert gate.admit(8, finding("step_time", "rank 2")).count == 2  # one step-time page


def test_the_gate_survives_a_round_trip_and_reads_an_older_state():
    gate = PageGate(rearm_steps=10)
    gate.admit(5, finding()).record = {"message": "m", "culprit": "", "ranks": []}
    gate.admit(9, finding())
    again = PageGate.from_state(10, json.loads(json.dumps(gate.to_state())))
    e = again.admit(10, finding())  # continues the event of step 9
    assert (e.first_step, e.count, e.new_event, e.record["message"]) == (5, 2, False, "m")
    old = PageGate.from_state(10, {"cospike": 40})  # before episodes: the last page's step
    assert old.admit(45, finding()).first_step == 40


# -- two co-spikes in one episode -------------------------------------------------------------
def test_two_cospikes_in_one_episode_are_two_anomalies_both_retained_one_updated_page():
    rng = np.random.default_rng(1)
    n = 90
    losses = 3.0 * np.exp(rng.normal(0, 0.01, n))
    grads = 0.5 * np.exp(rng.normal(0, 0.05, n))
    for s in (40, 55):  # 15 steps apart: inside the 30-step episode
        losses[s] *= 3.0
        grads[s] *= 20.0
    run = RunPipeline("run", config())
    rows = collect(run, [records(i, [(losses[i] * 10, 10.0)], g2=grads[i] ** 2) for i in range(n)])
    cospikes = [a["step"] for a in rows["anomalies"] if a["signal"] == "cospike"]
    assert cospikes == [40, 55]
    assert [r["cospike_count"] for r in rows["step_metrics"]][54:56] == [1, 2]
    # one page; the second co-spike updates its record (same key: it replaces the stored row)
    assert [(a["step"], a["signal"]) for a in rows["alerts"]] == [(40, "cospike")] * 2
    first, update = rows["alerts"]
    assert "episode" not in first["message"]
    assert "episode: 2 events, the latest at step 55" in update["message"]
    assert update["message"].startswith(first["message"])
    assert (update["value"], update["tokens"]) == (first["value"], first["tokens"])
    # both halos are retained
    anomaly_steps = {a["step"] for a in rows["anomalies"]}
    promoted = sorted(rows["promote"])
    assert promoted == sorted(
        retained_steps(n, anomaly_steps, k=10, halo=5, warmup_steps=3, final_steps=4)
    )
    for s in (40, 55):
        assert set(range(s - 5, s + 6)) <= set(promoted)


def test_a_cospike_after_the_episode_rearms_is_a_new_page():
    rng = np.random.default_rng(2)
    n = 120
    losses = 3.0 * np.exp(rng.normal(0, 0.01, n))
    grads = 0.5 * np.exp(rng.normal(0, 0.05, n))
    for s in (40, 100):  # 60 steps apart: past the 30-step rearm
        losses[s] *= 3.0
        grads[s] *= 20.0
    rows = collect(
        RunPipeline("run", config()),
        [records(i, [(losses[i] * 10, 10.0)], g2=grads[i] ** 2) for i in range(n)],
    )
    assert [(a["step"], a["signal"]) for a in rows["alerts"]] == [(40, "cospike"), (100, "cospike")]
    assert all("episode" not in a["message"] for a in rows["alerts"])


# -- the culprit's own move -------------------------------------------------------------------
def rank_run(n: int, scale: dict[tuple[int, int], float], ranks: int = 3, seed: int = 5):
    """``ranks`` ranks with steady losses; ``scale[(step, rank)]`` multiplies one rank's
    loss at one step (below 1: an easy batch)."""
    rng = np.random.default_rng(seed)
    items = []
    for step in range(n):
        noise = rng.normal(0, 0.01, ranks)
        per_rank = [
            (3.0 * (1 + noise[r]) * scale.get((step, r), 1.0) * 10, 10.0) for r in range(ranks)
        ]
        items.append(records(step, per_rank, g2=0.25 * float(np.exp(rng.normal(0, 0.05)))))
    return collect(RunPipeline("run", config()), items)


@pytest.mark.parametrize("ranks", [2, 3])
def test_an_easy_batch_on_one_rank_pages_nobody(ranks):
    """Rank 0's loss falls to a third: L falls and L_max / L jumps, but the worst rank's own
    loss did not move; the gap is recorded as an anomaly that does not page."""
    rows = rank_run(60, {(40, 0): 1 / 3}, ranks=ranks)
    gap = [r["loss_worst_rank"] / r["loss"] for r in rows["step_metrics"]]
    assert gap[40] > 1.2 * max(gap[20:40])  # the old ratio rule paged here
    assert rows["alerts"] == []
    (anomaly,) = [a for a in rows["anomalies"] if a["signal"] == "loss_worst_rank"]
    assert (anomaly["step"], anomaly["kind"]) == (40, "gap")
    assert anomaly["culprit"] != "rank 0"


def test_a_bad_rank_pages_naming_it_with_its_own_baseline():
    rows = rank_run(60, {(40, 2): 2.0})
    (alert,) = [a for a in rows["alerts"] if a["signal"] == "loss_worst_rank"]
    assert (alert["step"], alert["culprit"], alert["ranks"]) == (40, "rank 2", [2])
    assert alert["value"] == pytest.approx(6.0, rel=0.05)  # L_2 itself
    assert alert["baseline"] == pytest.approx(3.0, rel=0.05)  # rank 2's own history
    assert alert["z"] > 8


def test_every_rank_moving_together_is_not_a_worst_rank_page():
    rows = rank_run(60, {(40, r): 2.0 for r in range(3)})
    assert not [a for a in rows["alerts"] if a["signal"] == "loss_worst_rank"]


def source_run(n: int, docs_scale: dict[int, float], rare_scale: dict[int, float]):
    rng = np.random.default_rng(6)
    items = []
    for step in range(n):
        noise = rng.normal(0, 0.01, 2)
        docs = 2.0 * (1 + noise[0]) * docs_scale.get(step, 1.0)
        rare = 4.0 * (1 + noise[1]) * rare_scale.get(step, 1.0)
        src = {0: {"docs": (docs * 9.0, 9.0), "rare": (rare * 1.0, 1.0)}}
        items.append(records(step, [(docs * 9.0 + rare, 10.0)], sources=src))
    return collect(RunPipeline("run", config()), items)


def test_a_source_whose_loss_did_not_move_is_not_paged_when_the_rest_falls():
    rows = source_run(60, {40: 0.3}, {})  # the big source gets an easy batch: L falls
    assert not [a for a in rows["alerts"] if a["signal"] == "loss_by_source"]
    assert [
        (a["step"], a["kind"], a["culprit"])
        for a in rows["anomalies"]
        if a["signal"] == "loss_by_source"
    ] == [(40, "gap", "source rare")]


def test_a_source_whose_own_loss_rose_is_paged():
    rows = source_run(60, {}, {40: 2.5})
    (alert,) = [a for a in rows["alerts"] if a["signal"] == "loss_by_source"]
    assert (alert["step"], alert["culprit"]) == (40, "source rare")
    assert alert["value"] == pytest.approx(10.0, rel=0.05)
    assert alert["baseline"] == pytest.approx(4.0, rel=0.05)


def test_a_bad_rank_does_not_page_the_sources_it_holds_but_a_source_moving_elsewhere_does():
    """Rank 2 goes bad (every source it holds rises): the rank pages, its sources are
    recorded without a page. At the same step the rare source regresses on rank 0, which
    is not the bad rank: that source still pages."""
    rng = np.random.default_rng(8)
    items = []
    for step in range(60):
        noise = rng.normal(0, 0.01, 3)
        src = {}
        for r in range(3):
            bad = 3.0 if (step >= 40 and r == 2) else 1.0
            rare = 4.0 * (1 + noise[r]) * bad * (2.5 if (step >= 40 and r == 0) else 1.0)
            docs = 2.0 * (1 + noise[r]) * bad
            src[r] = {"docs": (docs * 9.0, 9.0), "rare": (rare, 1.0)}
        per_rank = [(src[r]["docs"][0] + src[r]["rare"][0], 10.0) for r in range(3)]
        items.append(records(step, per_rank, sources=src))
    rows = collect(RunPipeline("run", config()), items)
    pages = {(a["step"], a["signal"], a["culprit"]) for a in rows["alerts"]}
    assert (40, "loss_worst_rank", "rank 2") in pages
    assert (40, "loss_by_source", "source rare") in pages
    assert (40, "loss_by_source", "source docs") not in pages
