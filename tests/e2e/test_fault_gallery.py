"""The fault gallery: every fault of ``probewire.deploy.demo.faults`` on the real pipeline.

One broker, one stream worker and one store for the whole module (``Gallery``): each
fault trains the 2-rank demo (gloo DDP -> OTLP -> Kafka -> Faust -> chdb) as its own run
id, with the fault at step ``FAULT_STEP``; a fault-free run of ``HEALTHY_STEPS`` steps is
one more run id. Once every run the selected tests need has trained, the worker stops and
one fresh process reads everything back (chdb: one process per data directory): the page
records, the straggler's rank per step, and ``probewire explain`` at each fault's page.
Each test checks a fault's documented signature: the P0 alert that pages and its step,
what explain names, and that no other P0 alert fires; the fault-free run must page nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from probewire.deploy.demo.faults import FAULTS, BadRank, Straggler, demo_train_args, parse_fault
from probewire.deploy.demo.gallery import Explain, Gallery, read_gallery

pytestmark = pytest.mark.integration

FAULT_STEP = 120
STEPS = 150
HEALTHY_STEPS = 800
WINDOW = 50  # detector window: short runs, the detectors are warm by FAULT_STEP
DB = "probewire"
HEALTHY = "healthy"
EARLY = (16, "cospike")
"""The tiny demo's default data can hold a real co-spike at step 16 (G2 ~100x its
baseline, L +28%; whether it does depends on the run's length, through its learning-rate
schedule): the early regime (issue 38) pages it, long before the fault."""
# the straggler sleeps 1 s a slow step, not its default 3 s: its own-time ratio is ~20
# either way (the waiting rank's own time is floored at 5 % of the step), 20 s less to wait
PARAMS = {Straggler.name: ":delay_s=1"}


def _text(name: str) -> str:
    """The --fault text of ``name``'s run."""
    return f"{name}@{FAULT_STEP}{PARAMS.get(name, '')}"


def _traces(trace: Path) -> dict[int, dict[int, dict]]:
    return {
        rank: {
            rec["step"]: rec
            for rec in map(json.loads, (trace / f"rank{rank}.jsonl").read_text().splitlines())
        }
        for rank in (0, 1)
    }


def _needed(session: pytest.Session) -> list[str]:
    """The runs the selected tests of this module read: their fault, or the healthy run."""
    names: list[str] = []
    for item in session.items:
        if item.module is None or item.module.__name__ != __name__:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        name = params.get("name") or getattr(item.function, "run", None)
        if name and name not in names:
            names.append(name)
    return names


@pytest.fixture(scope="module")
def gallery(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """{name: (fault or None, alerts, straggler rank by step, explanation, traces)} for
    every run the selected tests need, trained through one stack and read in one process."""
    base = tmp_path_factory.mktemp("gallery")
    names = _needed(request.session)
    with Gallery(
        base, window=WINDOW, database=DB, bootstrap=os.environ.get("KAFKA_BOOTSTRAP")
    ) as g:
        for name in names:
            if name == HEALTHY:
                result = g.run(HEALTHY, steps=HEALTHY_STEPS, timeout_s=1800)
                steps = HEALTHY_STEPS
            else:
                fault = parse_fault(_text(name))
                steps = FAULT_STEP + fault.duration if isinstance(fault, Straggler) else STEPS
                result = g.run(
                    name,
                    steps=steps,
                    trace=base / name / "trace",
                    train_args=demo_train_args([_text(name)]),
                )
            assert result.steps_written == steps, name
    explains = [Explain(n, FAULTS[n].signal, FAULT_STEP, WINDOW) for n in names if n in FAULTS]
    read = read_gallery(
        g.store,
        {
            "alerts": f"SELECT run_id, step, signal, culprit, value, baseline, z, message FROM "
            f"{DB}.alerts FINAL ORDER BY run_id, step, signal",
            "straggler": f"SELECT run_id, step, straggler_rank FROM {DB}.step_metrics FINAL "
            f"WHERE run_id = '{Straggler.name}' ORDER BY step",
        },
        explains,
        DB,
    )
    out = {}
    for name in names:
        alerts = [a for a in read["sql"]["alerts"] if a["run_id"] == name]
        before = {(a["step"], a["signal"]) for a in alerts if a["step"] < FAULT_STEP}
        assert before <= {EARLY}, (name, before)
        alerts = [a for a in alerts if a["step"] >= FAULT_STEP]
        straggler = {
            r["step"]: r["straggler_rank"] for r in read["sql"]["straggler"] if r["run_id"] == name
        }
        trace = base / name / "trace"
        out[name] = (
            FAULTS.get(name) and parse_fault(_text(name)),
            alerts,
            straggler,
            read["explain"].get(name),
            _traces(trace) if trace.exists() else None,
        )
    return out


def _check_pages(name: str, fault, alerts: list[dict], check_culprit: bool = True) -> int:
    """The documented P0 signal pages at the fault's step (or within its documented delay),
    and nothing unrelated pages; returns the paging step."""
    seen = [(a["step"], a["signal"], a["culprit"]) for a in alerts]
    pages = [a for a in alerts if a["signal"] == fault.signal]
    assert pages, f"{name}: no {fault.signal} alert; alerts: {seen}"
    first = pages[0]["step"]
    assert FAULT_STEP <= first <= FAULT_STEP + fault.within, (
        f"{name}: {fault.signal} paged at step {first}, expected {FAULT_STEP}"
        f"{f'..{FAULT_STEP + fault.within}' if fault.within else ''}; alerts: {seen}"
    )
    allowed = {fault.signal, *fault.also_pages}
    assert all(
        a["signal"] in allowed and FAULT_STEP <= a["step"] <= FAULT_STEP + fault.within
        for a in alerts
    ), f"{name}: unrelated P0 alerts: {seen}"
    expected = fault.expected_culprit()
    if check_culprit:  # single-culprit signals carry it on the alert; a co-spike carries none
        assert all(
            a["culprit"].startswith(expected) if expected else a["culprit"] == "" for a in pages
        ), (
            f"{name}: the {fault.signal} alert names {[a['culprit'] for a in pages]}, "
            f"expected {expected!r}"
        )
    return first


def _gap(name: str):
    reason = FAULTS[name].explain_gap
    return (
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else name
    )


@pytest.mark.parametrize("name", [n for n in FAULTS if n != Straggler.name])
def test_fault_pages_its_signal_at_its_step(name: str, gallery):
    fault, alerts, _, _, _ = gallery[name]
    _check_pages(name, fault, alerts)


def test_straggler_pages_step_time(gallery):
    """`step_time` pages within the fault's ``within`` steps naming the slow rank, on any
    host: the straggler rule (the rank's own-time ratio at least ``straggler_ratio`` x its
    own baseline on ``straggler_steps`` consecutive steps, the job's step time at least
    ``straggler_job_slowdown`` x its median on each: a 1 s sleep on ~40 ms steps is ~25x)
    does not depend on the step time's own noise."""
    fault, alerts, _, _, _ = gallery[Straggler.name]
    _check_pages(fault.name, fault, alerts)


test_straggler_pages_step_time.run = Straggler.name  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", [_gap(n) for n in FAULTS])
def test_explain_names_the_culprit(name: str, gallery):
    fault, _, _, explanation, _ = gallery[name]
    expected = fault.explain_culprit()
    named = [
        (f["signal"], f["culprit"], f["moved"], f["onset_step"])
        for f in explanation["findings"]
        if f["stage"] == fault.explain_stage
        and (fault.explain_signal is None or f["signal"] == fault.explain_signal)
    ]
    ok = [
        n
        for n in named
        if expected in (n[1] or "")
        and (not fault.explain_moves or (n[2] and n[3] is not None and n[3] >= FAULT_STEP))
    ]
    assert ok, (
        f"{name}: explain's {fault.explain_stage} stage does not name {expected!r}"
        f"{' as moved since the fault' if fault.explain_moves else ''}: {named}; "
        f"headline: {explanation['headline']}"
    )


def test_explains_headline_at_the_bad_rank_page_names_the_loss_and_the_rank(gallery):
    fault, _, _, explanation, _ = gallery[BadRank.name]
    assert explanation["step"] == FAULT_STEP
    headline = explanation["headline"]
    assert headline.startswith(f"Paged at step {FAULT_STEP}: loss_worst_rank (loss)"), headline
    assert f"carried by rank {fault.rank}" in headline, headline
    assert explanation["first"] == "loss_worst_rank"


test_explains_headline_at_the_bad_rank_page_names_the_loss_and_the_rank.run = BadRank.name  # type: ignore


def test_straggler_comm_wait_names_the_slow_rank(gallery):
    """Step time minus the rank's own wait on DDP's gradient all-reduce (the comm hook of
    train.py, written to the trace) names the straggler on every slow step."""
    fault, _, _, _, traces = gallery[Straggler.name]
    for step in range(FAULT_STEP, FAULT_STEP + fault.duration):
        own = {r: traces[r][step]["step_time_s"] - traces[r][step]["comm_wait_s"] for r in (0, 1)}
        assert max(own, key=own.__getitem__) == fault.rank, (step, own)
        # the fast rank waits out most of the delay in the all-reduce
        assert traces[1 - fault.rank][step]["comm_wait_s"] > 0.5 * fault.delay_s, step


test_straggler_comm_wait_names_the_slow_rank.run = Straggler.name  # type: ignore


def test_straggler_step_time_alert_names_the_slow_rank(gallery):
    """The alert's culprit and explain's step-time culprit are both ``straggler_rank``;
    it must name the slow rank on every slow step (a coin toss passes 10 steps 1 in 1024)."""
    fault, alerts, ranks, _, _ = gallery[Straggler.name]
    pages = [a for a in alerts if a["signal"] == "step_time"]
    assert pages and all(a["culprit"] == f"rank {fault.rank}" for a in pages)
    slow = range(FAULT_STEP, FAULT_STEP + fault.duration)
    assert [ranks[s] for s in slow] == [fault.rank] * len(slow)


test_straggler_step_time_alert_names_the_slow_rank.run = Straggler.name  # type: ignore


@pytest.mark.slow
def test_fault_free_run_raises_no_p0_alert(gallery):
    _, alerts, _, _, _ = gallery[HEALTHY]
    assert alerts == [], [(a["step"], a["signal"], a["culprit"]) for a in alerts]


test_fault_free_run_raises_no_p0_alert.run = HEALTHY  # type: ignore[attr-defined]
