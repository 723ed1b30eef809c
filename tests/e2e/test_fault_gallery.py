"""The fault gallery: every fault of ``probewire.deploy.demo.faults`` on the real pipeline.

Each test runs the 2-rank demo (gloo DDP -> OTLP -> Kafka -> Faust -> chdb) for a short
run with one fault at step ``FAULT_STEP`` and checks the fault's documented signature:
the P0 alert that pages and its step, what ``probewire explain`` names, and that no other
P0 alert fires. A fault-free run of ``HEALTHY_STEPS`` steps must raise no alert at all.

The stores are written by the stream worker (another process), so they are read back in
fresh processes (chdb opens one data directory per process): ``read_store`` for SQL and
``probewire explain --format json`` for the explanation.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from probewire.deploy.demo.faults import FAULTS, Straggler, demo_train_args, parse_fault
from probewire.deploy.demo.run import run_demo
from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import Stage2Config

pytestmark = pytest.mark.integration

FAULT_STEP = 120
STEPS = 150
HEALTHY_STEPS = 2000
WINDOW = 50          # detector window: short runs, the detectors are warm by FAULT_STEP
DB = "probewire"


def _settings(store: Path) -> Settings:
    return Settings(clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/"),
                                                  database=DB),
                    stream=StreamSettings(stage2=Stage2Config(detectors=DetectorConfig(window=WINDOW))))


def _explain(store: Path, run_id: str, step: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "probewire.deploy.cli", "explain", "--run", run_id,
         "--step", str(step), "--store", str(store), "--format", "json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"probewire explain failed: {out.stderr}"
    return json.loads(out.stdout)


def _traces(trace: Path) -> dict[int, dict[int, dict]]:
    return {rank: {rec["step"]: rec for rec in map(
        json.loads, (trace / f"rank{rank}.jsonl").read_text().splitlines())} for rank in (0, 1)}


def _run(base: Path, read_store, spec: str, steps: int):
    store = base / "store"
    result = run_demo(_settings(store), ranks=2, steps=steps, work_dir=base / "run",
                      trace=base / "trace",
                      extra_train_args=demo_train_args([spec] if spec else []),
                      show_progress=False, bootstrap=os.environ.get("KAFKA_BOOTSTRAP"))
    assert result.steps_written == steps
    alerts = read_store(store, f"SELECT step, signal, culprit, value, baseline, z FROM "
                               f"{DB}.alerts WHERE run_id = '{result.run_id}' ORDER BY step")
    return result, store, alerts


def _straggler_ranks(store: Path, run_id: str, read_store) -> dict[int, int]:
    rows = read_store(store, f"SELECT step, straggler_rank FROM {DB}.step_metrics FINAL "
                             f"WHERE run_id = '{run_id}' ORDER BY step")
    return {r["step"]: r["straggler_rank"] for r in rows}


def _check_pages(name: str, fault, alerts: list[dict], check_culprit: bool = True) -> int:
    """The documented P0 signal pages at the fault's step (or within its documented delay),
    and nothing unrelated pages; returns the paging step."""
    seen = [(a["step"], a["signal"], a["culprit"]) for a in alerts]
    pages = [a for a in alerts if a["signal"] == fault.signal]
    assert pages, f"{name}: no {fault.signal} alert; alerts: {seen}"
    first = pages[0]["step"]
    assert FAULT_STEP <= first <= FAULT_STEP + fault.within, \
        f"{name}: {fault.signal} paged at step {first}, expected {FAULT_STEP}" \
        f"{f'..{FAULT_STEP + fault.within}' if fault.within else ''}; alerts: {seen}"
    allowed = {fault.signal, *fault.also_pages}
    assert all(a["signal"] in allowed and FAULT_STEP <= a["step"] <= FAULT_STEP + fault.within
               for a in alerts), f"{name}: unrelated P0 alerts: {seen}"
    expected = fault.expected_culprit()
    if check_culprit:  # single-culprit signals carry it on the alert; a co-spike carries none
        assert all(a["culprit"].startswith(expected) if expected else a["culprit"] == ""
                   for a in pages), \
            f"{name}: the {fault.signal} alert names {[a['culprit'] for a in pages]}, " \
            f"expected {expected!r}"
    return first


_RUNS: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory: pytest.TempPathFactory, read_store):
    """``fault_run(name) -> (fault, run_id, store, alerts, traces)``: one demo per fault,
    shared by the tests of that fault."""
    def get(name: str):
        if name not in _RUNS:
            fault = parse_fault(f"{name}@{FAULT_STEP}")
            base = tmp_path_factory.mktemp(name.replace("-", "_"))
            steps = FAULT_STEP + fault.duration if isinstance(fault, Straggler) else STEPS
            result, store, alerts = _run(base, read_store, f"{name}@{FAULT_STEP}", steps)
            _RUNS[name] = (fault, result.run_id, store, alerts, _traces(base / "trace"))
        return _RUNS[name]

    yield get
    _RUNS.clear()


def _gap(name: str):
    reason = FAULTS[name].explain_gap
    return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason)) \
        if reason else name


@pytest.mark.parametrize("name", [n for n in FAULTS if n != Straggler.name])
def test_fault_pages_its_signal_at_its_step(name: str, fault_run):
    fault, _, _, alerts, _ = fault_run(name)
    _check_pages(name, fault, alerts)


def test_straggler_pages_step_time(fault_run):
    """`step_time` pages within the fault's ``within`` steps naming the slow rank, on any
    host: the straggler rule (the same rank's own-time ratio over ``straggler_ratio`` for
    ``straggler_steps`` consecutive steps) does not depend on the step time's own noise,
    which keeps the spike rule (z > 8 on log step time) silent on a busy shared host."""
    fault, _, _, alerts, _ = fault_run(Straggler.name)
    _check_pages(fault.name, fault, alerts)


@pytest.mark.parametrize("name", [_gap(n) for n in FAULTS])
def test_explain_names_the_culprit(name: str, fault_run):
    fault, run_id, store, alerts, _ = fault_run(name)
    pages = [a["step"] for a in alerts if a["signal"] == fault.signal]
    step = pages[0] if pages else FAULT_STEP
    explanation = _explain(store, run_id, step)
    expected = fault.explain_culprit()
    named = [(f["signal"], f["culprit"], f["moved"], f["onset_step"])
             for f in explanation["findings"] if f["stage"] == fault.explain_stage
             and (fault.explain_signal is None or f["signal"] == fault.explain_signal)]
    ok = [n for n in named if expected in (n[1] or "")
          and (not fault.explain_moves or (n[2] and n[3] is not None and n[3] >= FAULT_STEP))]
    assert ok, f"{name}: explain's {fault.explain_stage} stage does not name {expected!r}" \
               f"{' as moved since the fault' if fault.explain_moves else ''}: {named}; " \
               f"headline: {explanation['headline']}"


def test_straggler_comm_wait_names_the_slow_rank(fault_run):
    """Step time minus the rank's own wait on DDP's gradient all-reduce (the comm hook of
    train.py, written to the trace) names the straggler on every slow step."""
    fault, _, _, _, traces = fault_run(Straggler.name)
    for step in range(FAULT_STEP, FAULT_STEP + fault.duration):
        own = {r: traces[r][step]["step_time_s"] - traces[r][step]["comm_wait_s"]
               for r in (0, 1)}
        assert max(own, key=own.__getitem__) == fault.rank, (step, own)
        # the fast rank waits out most of the delay in the all-reduce
        assert traces[1 - fault.rank][step]["comm_wait_s"] > 0.5 * fault.delay_s, step


def test_straggler_step_time_alert_names_the_slow_rank(fault_run, read_store):
    """The alert's culprit and explain's step-time culprit are both ``straggler_rank``;
    it must name the slow rank on every slow step (a coin toss passes 10 steps 1 in 1024)."""
    fault, run_id, store, alerts, _ = fault_run(Straggler.name)
    pages = [a for a in alerts if a["signal"] == "step_time"]
    assert pages and all(a["culprit"] == f"rank {fault.rank}" for a in pages)
    ranks = _straggler_ranks(store, run_id, read_store)
    slow = range(FAULT_STEP, FAULT_STEP + fault.duration)
    assert [ranks[s] for s in slow] == [fault.rank] * len(slow)


@pytest.mark.slow
def test_fault_free_run_raises_no_p0_alert(tmp_path_factory: pytest.TempPathFactory,
                                           read_store):
    base = tmp_path_factory.mktemp("healthy")
    result, store, alerts = _run(base, read_store, "", HEALTHY_STEPS)
    assert alerts == [], [(a["step"], a["signal"], a["culprit"]) for a in alerts]
