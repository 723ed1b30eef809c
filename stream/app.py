"""The Faust app: topics wired to small agents; the math lives in pure modules.

    otlp_metrics --(decode, assemble per run:step)--> probewire.steps --(per run)--> ClickHouse
                 \\--(malformed)--> probewire.deadletter

Agent ``assemble`` (stage 1) keys by ``<run_id>:<step>`` and reduces across ranks;
agent ``per_run`` (stage 2) keys by ``run_id``, orders steps and writes the rows.
Stage 2 awaits the store write before taking the next batch, so Faust acknowledges
(and commits) the offsets only for events whose rows are durable.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import faust

from probewire.deploy.health import Heartbeat
from probewire.deploy.settings import Settings
from probewire.sinks.clickhouse import ClickHouseSink, connect

from .assemble import StepAssembler
from .decode import DecodeError, decode_rank_step
from .records import ReducedStep
from .runstate import RunState, StepOrderer

__all__ = ["create_app"]

log = logging.getLogger(__name__)


def _rank_rows(reduced: ReducedStep, late: bool) -> list[dict]:
    return [{"run_id": reduced.run_id, "step": reduced.step, "rank": rank, "metric": name,
             "labels": "|".join(f"{k}={v}" for k, v in labels), "value": value, "late": int(late)}
            for rank, values in reduced.per_rank.items() for (name, labels), value in values.items()]


def create_app(settings: Settings, heartbeat_path: Path) -> faust.App:
    """Build the worker's app from one settings tree (decided once, here)."""
    topics = settings.topics
    app = faust.App(
        settings.stream.app_id,
        broker=f"kafka://{settings.kafka.bootstrap}",
        broker_session_timeout=6.0,
        broker_heartbeat_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
        web_enabled=False,
        web_bind=settings.stream.web_bind,
        consumer_auto_offset_reset="earliest",
        topic_partitions=topics.partitions,
        topic_allow_declare=False,
        producer_max_batch_size=64,
    )
    metrics_topic = app.topic(topics.metrics)
    steps_topic = app.topic(topics.steps)
    deadletter_topic = app.topic(topics.deadletter)

    assembler = StepAssembler(settings.stream.deadline_s)
    runs: dict[str, RunState] = {}
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probewire-sink")
    sink: list[ClickHouseSink] = []  # opened on start, in the worker process
    heartbeat = Heartbeat(heartbeat_path, "worker")

    def count_progress(step_rows: list[dict]) -> None:
        for row in step_rows:
            progress = heartbeat.runs.setdefault(row["run_id"], {"steps_written": 0})
            progress["steps_written"] += 1
            progress["last_step"] = max(progress.get("last_step", -1), row["step"])

    async def publish(reduced: ReducedStep) -> None:
        await steps_topic.send(key=reduced.run_id.encode(), value=reduced.to_json())

    async def store(table: str, rows: list[dict]) -> None:
        await asyncio.get_running_loop().run_in_executor(writer, sink[0].write, table, rows)

    @app.task
    async def open_store() -> None:
        ch = settings.clickhouse
        client = connect(ch.url, username=ch.username, password_env=ch.password_env)
        sink.append(ClickHouseSink(client, ch.database, ch.retry_max_s))
        await asyncio.get_running_loop().run_in_executor(writer, sink[0].migrate)
        heartbeat.beat("ready")

    @app.agent(metrics_topic)
    async def assemble(stream):
        async for event in stream.events():
            try:
                record = decode_rank_step(event.key, event.value)
            except DecodeError as exc:
                body = {"reason": exc.reason, "topic": event.message.topic,
                        "partition": event.message.partition, "offset": event.message.offset,
                        "payload_b64": base64.b64encode(event.value or b"").decode()}
                await deadletter_topic.send(key=event.key, value=json.dumps(body).encode())
                continue
            result = assembler.add(record, time.monotonic(), event.message.partition)
            for reduced in result.completed:
                await publish(reduced)
            if result.late is not None:
                late = ReducedStep(run_id=record.run_id, step=record.step,
                                   world_size=record.world_size, ranks_reporting=[record.rank],
                                   ranks_missing=[], reduced={},
                                   per_rank={record.rank: record.values},
                                   hosts={record.rank: record.host}, complete_reason="late")
                await publish(late)

    @app.timer(interval=1.0)
    async def deadlines() -> None:
        now = time.monotonic()
        for reduced in assembler.expire(now):
            await publish(reduced)
        if sink:
            rows = [asdict(row) for state in runs.values() for row in state.expire(now)]
            await store("step_metrics", rows)
            count_progress(rows)
        heartbeat.beat()

    @app.agent(steps_topic)
    async def per_run(stream):
        async for batch in stream.take(2000, within=0.5):
            while not sink:
                await asyncio.sleep(0.1)
            step_rows: list[dict] = []
            rank_rows: list[dict] = []
            for payload in batch:
                reduced = ReducedStep.from_json(payload)
                if reduced.complete_reason == "late":
                    rank_rows += _rank_rows(reduced, late=True)
                    continue
                state = runs.setdefault(reduced.run_id, RunState(
                    reduced.run_id, orderer=StepOrderer(settings.stream.deadline_s + 10.0)))
                rows = state.accept(reduced, time.monotonic())
                step_rows += [asdict(r) for r in rows]
                rank_rows += _rank_rows(reduced, late=False)
            await store("rank_metrics", rank_rows)
            await store("step_metrics", step_rows)
            count_progress(step_rows)
            heartbeat.beat()

    return app
