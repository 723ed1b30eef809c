"""The detectors of issue 38 on the real broker, worker and ClickHouse engine, with 4 simulated
synchronous DDP ranks (``stream.testing.SimRun``): a co-spike at step 20 pages, a rank 1.3x
slower for 20 steps pages within 20 steps naming it while a host-wide bursty load pages
nothing, one rank's loss shifted 10% from step 60 pages within 20 steps naming it, and the
grad-norm audit pages a loop that norms only its local shard, not one that norms globally.
One worker serves every run (one run id each); the alerts are read back from the store."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest
from test_stream_pipeline import wait_finished

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
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
}


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
        for run in runs.values():
            send(run, kafka_bootstrap, stack.settings.topics.metrics, range(run.steps))
        for run in runs.values():
            wait_finished(stack, run.run_id, timeout_s=240.0)
    finally:
        stack.stop()
    rows = read_store(
        base / "store",
        "SELECT run_id, step, signal, culprit, value, baseline, message "
        "FROM probewire.alerts FINAL ORDER BY run_id, step, signal",
    )
    return {
        name: [
            (r["step"], r["signal"], r["culprit"], r["value"], r["baseline"])
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
    step, _, _, value, baseline = got[0]
    assert 60 <= step < 80 and value / baseline == pytest.approx(1.1, rel=0.03)


def test_the_audit_pages_a_local_shard_norm_with_both_values_and_not_a_global_one(alerts):
    (audit,) = alerts["audit-local"]
    assert audit[:3] == (0, "grad_norm_audit", "the loop's gradient norm")
    assert audit[3] / audit[4] == pytest.approx(0.5, rel=1e-9)  # the shard's norm: G2 / sqrt(4)
    assert alerts["audit-global"] == []
