"""A step's fan-in spread over workers, on the real broker, workers and ClickHouse engine:
8 simulated ranks in blocks of 2 (keys run:step:block) reduced by the store owner and a
stage-1 worker, which both reduce blocks of the same steps (their heartbeats say which),
and the stored rows equal, bit for bit, those of one worker reducing whole steps."""

from __future__ import annotations

import dataclasses
import json
import struct
import time
import uuid
from pathlib import Path

import pytest
from test_detector_pipeline import settings_for
from test_stream_pipeline import wait_finished

from probewire.deploy.stack import LocalStack
from probewire.stream.testing import SimRun, send

pytestmark = pytest.mark.integration

RANKS, B = 8, 2


def stored(read_store, store, run_id: str) -> dict[str, list[dict]]:
    where = f"WHERE run_id = '{run_id}'"
    return {
        "step_metrics": read_store(
            store,
            "SELECT * EXCEPT (run_id, inserted_at) FROM probewire.step_metrics FINAL "
            f"{where} ORDER BY step",
        ),
        "rank_metrics": read_store(
            store,
            "SELECT step, rank, metric, labels, value FROM probewire.rank_metrics_recent FINAL "
            f"{where} ORDER BY step, rank, metric, labels",
        ),
    }


def block_steps(beats: list[Path], run_id: str) -> list[set[int]]:
    """The steps each worker reduced blocks of (its heartbeat's ``block_steps``)."""
    found = []
    for path in beats:
        beat = json.loads(path.read_text()) if path.exists() else {}
        found.append(set(beat.get("runs", {}).get(run_id, {}).get("block_steps", [])))
    return found


def run_stack(kafka_bootstrap, base, run: SimRun, block_ranks: int, stage1: int, steps: int):
    """Send ``run``'s steps, two every half second: with a stage-1 worker, until both
    workers reduced blocks of one step (the group's rebalance that hands the second one its
    partitions can end seconds after it is ready) or ``steps`` are sent; (steps sent, the
    steps each worker reduced blocks of)."""
    settings = settings_for(base / "store")
    settings = dataclasses.replace(
        settings, stream=dataclasses.replace(settings.stream, block_ranks=block_ranks)
    )
    stack = LocalStack(settings, base / "run")
    beats = [stack.heartbeat_path]
    beats += [base / "run" / f"worker-stage1-{i}.heartbeat" for i in range(stage1)]
    sent = 0
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        stack.start_stage1_workers(stage1)
        while sent < steps:
            topic = settings.topics.metrics
            send(run, kafka_bootstrap, topic, range(sent, sent + 2), block_ranks=block_ranks)
            sent += 2
            time.sleep(0.5)
            if stage1 and sent >= 12 and set.intersection(*block_steps(beats, run.run_id)):
                break
        wait_finished(stack, run.run_id, timeout_s=180.0)
        time.sleep(1.5)  # the heartbeats are written once a second
        blocks = block_steps(beats, run.run_id)
    finally:
        stack.stop()
    return sent, blocks


def as_bits(rows: list[dict]) -> list[dict]:
    return [
        {k: struct.pack("<d", v) if isinstance(v, float) else v for k, v in row.items()}
        for row in rows
    ]


def test_two_workers_reduce_blocks_of_one_step_and_store_the_single_workers_rows(
    kafka_bootstrap, tmp_path, read_store
):
    tag = uuid.uuid4().hex[:6]
    run = SimRun(
        run_id=f"fanin-{tag}",
        world_size=RANKS,
        steps=60,
        seed=5,
        ddp=True,
        clip_threshold=0.5,
        cospike_step=12,
    )
    sent, (owner, other) = run_stack(kafka_bootstrap, tmp_path / "blocks", run, B, 1, run.steps)
    _, single = run_stack(kafka_bootstrap, tmp_path / "whole", run, 256, 0, sent)
    assert single == [set()]  # one block: reduced whole, as before
    assert owner & other, f"no step had blocks on both workers: {owner} / {other}"
    spread = stored(read_store, tmp_path / "blocks" / "store", run.run_id)
    whole = stored(read_store, tmp_path / "whole" / "store", run.run_id)
    assert [r["step"] for r in spread["step_metrics"]] == list(range(sent))
    assert all(r["ranks_missing"] == [] for r in spread["step_metrics"])
    assert as_bits(spread["step_metrics"]) == as_bits(whole["step_metrics"])
    assert as_bits(spread["rank_metrics"]) == as_bits(whole["rank_metrics"])
    assert len(spread["rank_metrics"]) > RANKS * sent
