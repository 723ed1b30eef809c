"""The detectors of issue 38 on the real broker, worker and ClickHouse engine, with 4 simulated
synchronous DDP ranks (``stream.testing.SimRun``): a co-spike at step 20 pages, a rank 1.3x
slower for 20 steps pages within 20 steps naming it while a host-wide bursty load pages
nothing, one rank's loss shifted 10% from step 60 pages within 20 steps naming it, and the
grad-norm audit pages a loop that norms only its local shard, not one that norms globally;
a held-out BPB (evaluation records on the evals topic) that rises past its suite's recent
evaluations pages naming the suite, and a flat one does not. One worker serves every run
(one run id each); the alerts are read back from the store."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path

import pytest
from test_stream_pipeline import wait_finished

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
from probewire.instrument.export import KafkaTransport
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import Stage2Config
from probewire.stream.testing import SimRun, own_topics, send

pytestmark = pytest.mark.integration

BASE = SimRun(run_id="", world_size=4, steps=100, seed=3, ddp=True)
RUNS = {
    "early-spike": dataclasses.replace(BASE, steps=60, cospike_step=20),
    "stable": BASE,
    "straggler": dataclasses.replace(BASE, steps=110, slow=(1, 60, 20, 1.3)),
    "loaded-host": dataclasses.replace(BASE, steps=200, burner=True),
    "rank-shift": dataclasses.replace(BASE, steps=110, shift=(2, 60, 1.1)),
    "audit-local": dataclasses.replace(BASE, steps=30, clip_norm="local"),
    "audit-global": dataclasses.replace(BASE, steps=30, clip_norm="global"),
    "bpb-rise": dataclasses.replace(BASE, steps=30),
}
# held-out BPB of suite heldout every 100 steps (evaluator records): falling and flattening,
# then at step 1000 a rise of 8 % over the last five; the stable run's stays flat
BPB = {
    "bpb-rise": [1.0 + 0.5 * 0.7**i for i in range(10)] + [1.1, 1.0],
    "stable": [1.2] * 12,
}


def send_evaluations(bootstrap: str, topic: str, runs: dict) -> None:
    """Each run's BPB as the evaluator's records (raw weights, the reference stream)."""
    transport = KafkaTransport({"bootstrap.servers": bootstrap}, topic)
    for name, values in BPB.items():
        for i, value in enumerate(values):
            record = {
                "run_id": runs[name].run_id,
                "step": 100 * i,
                "tokens": 1000 * i,
                "flops": 0.0,
                "suite": "heldout",
                "metric": "bpb",
                "value": value,
                "n_items": 8,
                "weights_stream": "raw",
                "reference": 1,
            }
            transport.send(runs[name].run_id.encode(), json.dumps(record).encode())
    transport.close()


def wait_evaluations(stack: LocalStack, runs: dict, timeout_s: float = 120.0) -> None:
    """Until the worker has stored every run's evaluations (its heartbeat counts them)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat = json.loads(stack.heartbeat_path.read_text()) if stack.heartbeat_path.exists() else {}
        written = {n: beat.get("runs", {}).get(runs[n].run_id, {}) for n in BPB}
        if all(w.get("evals_written", 0) >= len(BPB[n]) for n, w in written.items()):
            return
        time.sleep(0.3)
    raise AssertionError(f"evaluations not stored; heartbeat: {beat}")


def settings_for(store: Path) -> Settings:
    tag = uuid.uuid4().hex[:8]
    return Settings(
        clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/")),
        topics=own_topics(tag),
        stream=StreamSettings(
            app_id=f"pw-test-{tag}",
            deadline_s=3.0,
            stage2=Stage2Config(
                detectors=DetectorConfig(window=50),
                retention_every_k=50,
                retention_halo=2,
                warmup_steps=2,
                final_steps=2,
                max_wait_s=13.0,
                run_idle_s=3.0,
            ),
        ),
    )


@pytest.fixture(scope="module")
def alerts(kafka_bootstrap, tmp_path_factory, read_store) -> dict[str, list[tuple]]:
    base = tmp_path_factory.mktemp("detectors")
    tag = uuid.uuid4().hex[:6]
    runs = {name: dataclasses.replace(run, run_id=f"{name}-{tag}") for name, run in RUNS.items()}
    stack = LocalStack(settings_for(base / "store"), base / "run")
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        send_evaluations(kafka_bootstrap, stack.settings.topics.evals, runs)
        for run in runs.values():
            send(run, kafka_bootstrap, stack.settings.topics.metrics, range(run.steps))
        for run in runs.values():
            wait_finished(stack, run.run_id, timeout_s=240.0)
        wait_evaluations(stack, runs)
    finally:
        stack.stop()
    rows = read_store(
        base / "store",
        "SELECT run_id, step, signal, culprit, value, baseline, message "
        "FROM probewire.alerts FINAL ORDER BY run_id, step, signal",
    )
    return {
        name: [
            (r["step"], r["signal"], r["culprit"], r["value"], r["baseline"], r["message"])
            for r in rows
            if r["run_id"] == run.run_id
        ]
        for name, run in runs.items()
    }


def pages(alerts, name: str) -> list[tuple[int, str, str]]:
    return [a[:3] for a in alerts[name]]


def test_a_cospike_at_step_20_pages_and_a_stable_run_pages_nothing_in_100_steps(alerts):
    assert pages(alerts, "early-spike") == [(20, "cospike", "")]
    assert pages(alerts, "stable") == []


def test_a_rank_13x_slower_for_20_steps_among_4_pages_within_20_steps_naming_it(alerts):
    got = pages(alerts, "straggler")
    assert got and {(s, c) for _, s, c in got} == {("step_time", "rank 1")}, got
    assert 60 <= got[0][0] < 80


def test_the_same_run_under_a_host_wide_bursty_load_pages_nothing(alerts):
    assert pages(alerts, "loaded-host") == []


def test_one_ranks_loss_shifted_pages_within_20_steps_naming_it(alerts):
    got = alerts["rank-shift"]
    assert [a[1:3] for a in got] == [("loss_rank_shift", "rank 2")], got
    step, _, _, value, baseline, _ = got[0]
    assert 60 <= step < 80 and value / baseline == pytest.approx(1.1, rel=0.03)


def test_the_audit_pages_a_local_shard_norm_with_both_values_and_not_a_global_one(alerts):
    (audit,) = alerts["audit-local"]
    assert audit[:3] == (0, "grad_norm_audit", "the loop's gradient norm")
    assert audit[3] / audit[4] == pytest.approx(0.5, rel=1e-9)  # the shard's norm: G2 / sqrt(4)
    assert alerts["audit-global"] == []


def test_a_heldout_bpb_rise_pages_naming_the_suite_and_a_flat_one_does_not(alerts):
    (page,) = alerts["bpb-rise"]  # the run's 30 steps page nothing; the evaluation at 1000
    base = sorted(BPB["bpb-rise"][5:10])[2]  # the median of the five evaluations before it
    assert page[:5] == (1000, "heldout_bpb", "suite heldout", 1.1, base)
    assert page[5] == (
        f"heldout_bpb rise at step 1000: 1.1 bits/byte against baseline {base:.4g} bits/byte; "
        "carried by suite heldout"
    )
    assert alerts["stable"] == []  # its BPB is flat (and its steps page nothing)
