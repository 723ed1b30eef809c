"""Pages never wait for detail, on the real broker, worker and ClickHouse engine: 4 simulated
ranks send a co-spike at step 15 on the step-tier topic (a ``--role detail`` worker reduces
the detail topic); its page is published while the
step's scan-tier detail has not even been sent. The detail, sent on its own topic after the
run went idle, is stored in the detail tables (promoted: the co-spike step is kept), and
its update ratio joins the step's row, equal to a float64 NumPy reference; a scan step the
retention does not keep stays in the look-back tables only."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import Consumer
from test_detector_pipeline import settings_for
from test_stream_pipeline import wait_finished

from probewire.deploy.stack import LocalStack
from probewire.instrument import MemoryTransport, Point, RankIdentity
from probewire.instrument.catalog import Label, Tensor
from probewire.instrument.export import KafkaTransport, StepEmitter
from probewire.stream.testing import SimRun, send

pytestmark = pytest.mark.integration

RANKS, SPIKE, KEPT_NOT = 4, 15, 21
TENSORS = ("blocks.0.w", "blocks.1.w")


def scan_points(step: int) -> tuple[list[Point], float]:
    """Every rank's scan-tier points of ``step`` (DDP replicas: the same on each rank) and
    the float64 reference rho = ||dw|| / (||w|| + 1e-12) over the tensors."""
    rng = np.random.default_rng(step)
    param, update = rng.uniform(1.0, 9.0, len(TENSORS)), rng.uniform(1e-6, 1e-4, len(TENSORS))
    points = []
    for tensor, p, u in zip(TENSORS, param, update):
        for kind, value in (("param", p), ("update", u)):
            labels = ((Label.TENSOR, tensor), (Label.KIND, kind))
            points += [Point(Tensor.SUM_SQ, float(value), labels), Point(Tensor.N, 64.0, labels)]
    rho = np.sqrt(np.sum(update, dtype=np.float64)) / (
        np.sqrt(np.sum(param, dtype=np.float64)) + 1e-12
    )
    return points, float(rho)


def send_detail(bootstrap: str, topic: str, run_id: str, steps: list[int]) -> None:
    for rank in range(RANKS):
        identity = RankIdentity(run_id=run_id, rank=rank, world_size=RANKS, coords={"dp": rank})
        emitter = StepEmitter(
            identity,
            MemoryTransport(),
            detail=KafkaTransport({"bootstrap.servers": bootstrap}, topic),
        )
        for step in steps:
            emitter.emit(step, scan_points(step)[0])
        emitter.close()


def wait_page(consumer: Consumer, run_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = consumer.poll(0.5)
        if message is None or message.error():
            continue
        alert = json.loads(message.value())
        if alert.get("run_id") == run_id:
            return alert
    raise AssertionError(f"no page of run {run_id} within {timeout_s} s")


def test_a_page_never_waits_for_its_steps_detail_which_is_stored_and_joined_later(
    kafka_bootstrap, tmp_path, read_store
):
    """The store owner leaves the detail topic to a ``--role detail`` worker (the owner
    reducing it too, the default, is what every demo of the e2e tier runs)."""
    run = SimRun(
        run_id=f"paths-{uuid.uuid4().hex[:6]}", world_size=RANKS, steps=30, cospike_step=SPIKE
    )
    settings = settings_for(tmp_path / "store")
    settings = dataclasses.replace(
        settings, stream=dataclasses.replace(settings.stream, detail_inline=False)
    )
    stack = LocalStack(settings, tmp_path / "run")
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_bootstrap,
            "group.id": f"pw-alerts-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
        }
    )
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        stack.start_stage1_workers(1, role="detail")
        consumer.subscribe([settings.topics.alerts])
        send(run, kafka_bootstrap, settings.topics.metrics, range(run.steps))
        page = wait_page(consumer, run.run_id, timeout_s=120.0)
        assert page["step"] == SPIKE  # paged with no detail sent at all
        wait_finished(stack, run.run_id, timeout_s=120.0)  # idle: the run went silent
        send_detail(kafka_bootstrap, settings.topics.detail, run.run_id, [SPIKE, KEPT_NOT])
        time.sleep(6.0)  # the detail reopens the idle run, which goes idle again
        wait_finished(stack, run.run_id, timeout_s=120.0)
        time.sleep(2.0)
    finally:
        consumer.close()
        stack.stop()
    store = tmp_path / "store"
    where = f"run_id = '{run.run_id}'"
    kept = read_store(
        store,
        f"SELECT step, tensor, kind, sum_sq FROM probewire.tensor_stats FINAL WHERE {where} ORDER BY step, tensor, kind",
    )
    assert {r["step"] for r in kept} == {SPIKE}  # the co-spike step is kept; 21 is not
    assert len(kept) == 2 * len(TENSORS)
    recent = read_store(
        store,
        f"SELECT DISTINCT step FROM probewire.tensor_stats_recent FINAL WHERE {where} ORDER BY step",
    )
    assert [r["step"] for r in recent] == [SPIKE, KEPT_NOT]
    rows = read_store(
        store,
        f"SELECT step, update_ratio, loss FROM probewire.step_metrics FINAL WHERE {where} ORDER BY step",
    )
    assert [r["step"] for r in rows] == list(range(run.steps))
    by_step = {r["step"]: r for r in rows}
    for step in (SPIKE, KEPT_NOT):
        assert by_step[step]["update_ratio"] == pytest.approx(scan_points(step)[1], rel=1e-12)
        assert by_step[step]["loss"] == pytest.approx(run.expected(step)[0], rel=1e-12)
    assert all(by_step[s]["update_ratio"] is None for s in by_step if s not in (SPIKE, KEPT_NOT))
