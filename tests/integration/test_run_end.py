"""A run's end on the real broker, worker and chdb, with simulated ranks (issue 37).

Two 2-rank runs, each clipping at c = 0.5 (``grad.clip_threshold`` and ``grad.clipped``
as ``s.clip_grad_norm_`` reports them), and a silence (``run_idle_s``) longer than the
test, so nothing is released by it:

- ``said``: 260 steps, ``finished`` naming step 259; rank 1 clips at 1.0 on steps 100-101;
- ``unnamed``: 150 steps, ``finished`` naming no step (the release waits, and only the
  worker's shutdown can give it).

After the worker has stopped, the durable detail (``rank_metrics``) of each run holds its
last 100 steps, the clip disagreement is one dead letter with its reason, and every
step's ``clipped`` is the float64 reference 1[G2 > 0.5].
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Producer

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
from probewire.instrument.lifecycle import run_event
from probewire.instrument.wire import RankIdentity
from probewire.stream.retention import retained_steps
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import Stage2Config
from probewire.stream.testing import SimRun, own_topics, send

pytestmark = pytest.mark.integration

RETENTION = dict(k=100, halo=5, warmup_steps=5, final_steps=100)
TAG = uuid.uuid4().hex[:6]
SAID, UNNAMED = (
    SimRun(
        run_id=f"said-{TAG}",
        world_size=2,
        steps=260,
        seed=3,
        clip_threshold=0.5,
        clip_other={(100, 1): 1.0, (101, 1): 1.0},
    ),
    SimRun(run_id=f"unnamed-{TAG}", world_size=2, steps=150, seed=4, clip_threshold=0.5),
)
RUNS = ((SAID, 259), (UNNAMED, -1))  # each run and the step its finished event names


def settings_for(store: Path) -> Settings:
    tag = uuid.uuid4().hex[:8]
    return Settings(
        clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/")),
        topics=own_topics(tag),
        stream=StreamSettings(
            app_id=f"pw-test-{tag}",
            deadline_s=3.0,
            stage2=Stage2Config(
                detectors=DetectorConfig(window=20),
                retention_every_k=RETENTION["k"],
                retention_halo=RETENTION["halo"],
                warmup_steps=RETENTION["warmup_steps"],
                final_steps=RETENTION["final_steps"],
                max_wait_s=13.0,
                run_idle_s=3600.0,  # the silence releases nothing here
            ),
        ),
    )


def wait_ended(stack: LocalStack, run: SimRun, timeout_s: float = 120.0) -> None:
    """Until the worker has stored the run's last step and its ``finished`` event."""
    deadline = time.monotonic() + timeout_s
    beat: dict = {}
    while time.monotonic() < deadline:
        if stack.heartbeat_path.exists():
            beat = json.loads(stack.heartbeat_path.read_text())
        progress = beat.get("runs", {}).get(run.run_id, {})
        if progress.get("last_step") == run.steps - 1 and progress.get("status") == "finished":
            return
        time.sleep(0.3)
    raise AssertionError(f"run {run.run_id} not ended; heartbeat: {beat}")


@pytest.fixture(scope="module")
def stored(kafka_bootstrap, tmp_path_factory, read_store):
    base = tmp_path_factory.mktemp("run-end")
    stack = LocalStack(settings_for(base / "store"), base / "run")
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        for run, named in RUNS:
            send(run, kafka_bootstrap, stack.settings.topics.metrics, range(run.steps))
            ident = RankIdentity(run_id=run.run_id, rank=0, world_size=run.world_size)
            for kind, step in (("started", -1), ("finished", named)):
                event = run_event(ident, kind, attempt="a1", step=step)
                producer.produce(stack.settings.topics.runs, key=run.run_id.encode(), value=event)
        producer.flush(10)
        for run, _ in RUNS:
            wait_ended(stack, run)
        time.sleep(1.5)  # the dead-letter agent batches for up to 1 s
    finally:
        stack.stop()  # SIGTERM: the worker's shutdown
    store = base / "store"
    got = {}
    for run, _ in RUNS:
        q = f"WHERE run_id = '{run.run_id}'"
        got[run.run_id] = {
            "retained": [
                r["step"]
                for r in read_store(
                    store,
                    f"SELECT DISTINCT step FROM probewire.rank_metrics FINAL {q} ORDER BY step",
                )
            ],
            "anomalies": {
                r["step"]
                for r in read_store(store, f"SELECT step FROM probewire.anomalies FINAL {q}")
            },
            "clipped": read_store(
                store, f"SELECT step, clipped FROM probewire.step_metrics FINAL {q} ORDER BY step"
            ),
        }
    got["dead_letters"] = read_store(
        store, "SELECT reason, payload_b64 FROM probewire.dead_letters FINAL"
    )
    return got


@pytest.mark.parametrize("run", [SAID, UNNAMED], ids=["said", "unnamed"])
def test_the_last_100_steps_are_durable_after_the_worker_stops(stored, run):
    """``said``: released when step 259 is in; ``unnamed``: at the worker's shutdown
    (before: nothing after the last multiple of 100 until a silence of ``run_idle_s``)."""
    got = stored[run.run_id]
    assert set(range(run.steps - 100, run.steps)) <= set(got["retained"])
    assert got["retained"] == sorted(retained_steps(run.steps, got["anomalies"], **RETENTION))


@pytest.mark.parametrize("run", [SAID, UNNAMED], ids=["said", "unnamed"])
def test_clipped_is_the_reference_every_step(stored, run):
    """clipped = 1[G2 > 0.5] (float64, from the simulated norms), on steps 100-101 too,
    where rank 1 clipped at 1.0: the step counts as clipped where any rank clipped."""
    norms = np.array(
        [np.sqrt(np.float64(run.components(s, 0)["grad.norm_sq"])) for s in range(run.steps)]
    )
    assert [r["step"] for r in stored[run.run_id]["clipped"]] == list(range(run.steps))
    assert [r["clipped"] for r in stored[run.run_id]["clipped"]] == list((norms > 0.5).astype(int))


def test_ranks_clipping_at_different_thresholds_are_one_dead_letter_with_the_reason(stored):
    said = SAID.run_id
    (letter,) = stored["dead_letters"]
    assert letter["reason"] == (
        f"step 100 of run {said!r}: grad.clip_threshold differs between ranks (c=0.5 on "
        "ranks [0]; c=1 on ranks [1]); clipped and clip_rate count a step any rank clipped: "
        "clip every rank at one max_norm"
    )
    assert letter["payload_b64"] == ""
