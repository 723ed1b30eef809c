"""Two workers on the real broker and the embedded store: the store owner (``--role all``)
and one ``--role stage1`` worker in the same consumer group. The ``otlp_metrics``
partitions are split between them; every step of 4 runs is stored exactly once, with the
float64 reference's loss and worst-rank loss, and both workers reduced steps."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
from probewire.stream.testing import SimRun, own_topics, send

pytestmark = pytest.mark.integration

RUNS, STEPS = 4, 40


def settings_for(store) -> Settings:
    tag = uuid.uuid4().hex[:8]
    return Settings(
        clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/")),
        topics=own_topics(tag),  # the session's broker holds other tests' steps
        stream=StreamSettings(app_id=f"pw-split-{tag}", deadline_s=3.0),
    )


def _stage1_outputs(heartbeat) -> int:
    beat = json.loads(heartbeat.read_text()) if heartbeat.exists() else {}
    return int(beat.get("stages", {}).get("stage1", {}).get("outputs", 0))


def test_two_workers_one_stage1_only_store_every_step_once_exactly(
    kafka_bootstrap, tmp_path_factory, read_store
):
    base = tmp_path_factory.mktemp("stage1-workers")
    runs = [
        SimRun(
            run_id=f"split{i}-{uuid.uuid4().hex[:6]}",
            world_size=8,
            steps=STEPS,
            seed=i,
            empty={(5, 2)},
        )
        for i in range(RUNS)
    ]
    stack = LocalStack(settings_for(base / "store"), base / "run")
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        stack.start_stage1_workers(1)
        # the steps over ~10 s: the group's rebalance that hands the second worker its
        # partitions can end after a burst has been read by the first
        for start in range(0, STEPS, 4):
            for run in runs:
                send(run, kafka_bootstrap, stack.settings.topics.metrics, range(start, start + 4))
            time.sleep(1.0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and min(stack.progress(r.run_id) for r in runs) < STEPS:
            time.sleep(0.3)
        time.sleep(1.5)  # the heartbeats count stage-1 outputs once a second
        outputs = {
            "owner": _stage1_outputs(stack.heartbeat_path),
            "stage1": _stage1_outputs(base / "run" / "worker-stage1-0.heartbeat"),
        }
    finally:
        stack.stop()
    assert outputs["owner"] > 0 and outputs["stage1"] > 0, outputs  # both reduced steps
    for run in runs:
        rows = read_store(
            base / "store",
            "SELECT step, loss, loss_worst_rank, ranks_reporting "
            "FROM probewire.step_metrics "
            f"WHERE run_id = '{run.run_id}' ORDER BY step",
        )
        assert [r["step"] for r in rows] == list(range(STEPS)), run.run_id  # once each
        for row in rows:
            expected_l, expected_max = run.expected(row["step"])
            assert row["loss"] == pytest.approx(expected_l, rel=1e-12, abs=0)
            assert row["loss_worst_rank"] == pytest.approx(expected_max, rel=1e-12, abs=0)
            assert row["ranks_reporting"] == 8
