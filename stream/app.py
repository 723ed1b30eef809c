"""The Faust app: topics wired to short agents; what they do reads in ``worker``.

    otlp_metrics ──assemble──► probewire.steps ──per_run──► ClickHouse (+ probewire.alerts,
         │   (stage 1, key run:step)     ▲      (stage 2, key run_id)     probewire.control,
         │                               │                                Alertmanager webhook)
    otlp_detail ──assemble_detail────────┤ (scan-tier points and ring dumps, gathered apart:
         │                               │  ``CompleteReason.SCAN`` / ``REPLAY`` steps)
         │  per-rank detail, tensor statistics, ring dumps (``split.wire_parts``):
         │     probewire.detail_steps (key run:step) ──store_detail──► ClickHouse look-back
    a step of more ranks than block_ranks: otlp_metrics (key run:step:block) ──assemble──►
         probewire.partials (key run:step) ──merge_blocks──┘ (``fanin``: blocks merged)
         └──► probewire.deadletter ──dead_letters──► ClickHouse
    probewire.evals ──evaluations──► ClickHouse (+ the held-out BPB page, ``heldout``)
    probewire.runs ──run_events──► ClickHouse (the run's status and config, ``lifecycle``)

Delivery is at-least-once and every write is idempotent:
- stage 1 acknowledges a rank message only once the broker confirmed its reduced step
  (every part of it), so a step pending at a crash or lost with a broker is re-assembled
  from re-delivered messages;
- stage 2 writes rows, promotes retained detail and saves the run's state in ClickHouse
  before it acknowledges the steps behind them (``batching``); on restart the state is
  loaded and re-delivered steps at or before the saved position are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faust
from faust.types import TP

from probewire.instrument.plumbing import KafkaConfig, TopicConfig
from probewire.sinks.clickhouse import ClickHouseSink

from .config import StreamConfig
from .consumer import Consumer, use_fetch_wait
from .gaps import GapReader
from .kafka import broker_credentials
from .publish import Publisher
from .worker import Worker, dead_letter_row

__all__ = ["create_app"]


class _App(faust.App):
    """Faust runs ``app.task``s only once the consumer group has its first assignment
    (seconds on a fresh group); the store opens as the app starts, while the group forms.
    Its consumer is ``consumer.Consumer``."""

    probewire_worker: Worker

    def _new_transport(self) -> Any:
        transport = super()._new_transport()
        transport.Consumer = Consumer
        return transport

    async def on_start(self) -> None:
        await super().on_start()
        self.add_future(self.probewire_worker.open())


def create_app(
    config: StreamConfig,
    kafka: KafkaConfig,
    topics: TopicConfig,
    open_store: Callable[[], ClickHouseSink],
    heartbeat_path: Path,
    before_event: Callable[..., bool] = lambda agent, partition=None: False,
) -> _App:
    """The worker's app, from built configs; ``open_store`` opens (and migrates) the store
    in the worker process; ``before_event`` is a fault-injection hook for tests."""
    use_fetch_wait(config.fetch_max_wait_ms)
    app = _new_app(config, kafka, topics, heartbeat_path)
    client_config = kafka.client_config()  # a missing SASL password fails here, at build
    worker = Worker(
        config,
        topics,
        lambda: Publisher(client_config, config.max_message_bytes),
        open_store,
        heartbeat_path,
        before_event,
        make_gap_reader=lambda: GapReader(client_config, config.app_id),
    )
    app.probewire_worker = worker
    worker.highwater = lambda topic, partition: _highwater(app, topic, partition)

    _stage1_agents(app, worker, topics, config)
    if config.role != "all":
        # Stage 1 only: this process subscribes to the rank topics alone, so Faust's
        # assignor splits their partitions over every worker of the group that subscribes
        # to them and gives the other topics to the workers that do (the store owner).
        return app
    _stage2_agents(app, worker, topics)
    return app


def _new_app(
    config: StreamConfig, kafka: KafkaConfig, topics: TopicConfig, heartbeat_path: Path
) -> _App:
    """The Faust app, its broker and consumer settings from the configs (no agents yet)."""
    return _App(
        config.app_id,
        broker=f"kafka://{kafka.bootstrap}",
        broker_credentials=broker_credentials(kafka),
        broker_session_timeout=6.0,
        broker_heartbeat_interval=1.0,
        key_serializer="raw",
        value_serializer="raw",
        web_enabled=False,
        web_bind=config.web_bind,
        consumer_auto_offset_reset="earliest",
        # messages are held unacknowledged on purpose (a step's rank messages until its last
        # rank, a batch until it is stored), and redelivery is harmless (stores dedupe):
        # Faust's default waits for every held message before a rebalance or a stop, so a
        # step that never completes held the worker until it was killed
        stream_wait_empty=False,
        consumer_max_fetch_size=config.max_message_bytes + 65_536,
        # no CRC32C of every fetched batch on this side (librdkafka's default too: the broker
        # checks what it is sent, TCP what it carries): aiokafka computes it in the consumer
        # thread holding the GIL, ~0.2 s for a 2,048-rank scan step's detail messages,
        # during which the page path's own thread waited (measured, docs/performance.md)
        broker_check_crcs=False,
        topic_partitions=topics.partitions,
        topic_allow_declare=False,
        # the worker keeps no Faust tables (state lives in ClickHouse), but Faust creates its
        # data directory anyway: next to the heartbeat file, never in the working directory
        datadir=str(heartbeat_path.parent / "faust-{conf.id}"),
    )


def _stage1_agents(app: _App, worker: Worker, topics: TopicConfig, config: StreamConfig) -> None:
    """Stage 1 on every worker: rank messages into steps (the step tier unless the role is
    ``detail``, the detail unless ``detail_inline`` is off on the store owner), the
    one-second tick, partition assignment and the store's close on shutdown."""

    if config.role != "detail":

        @app.agent(app.topic(topics.metrics))
        async def assemble(stream):
            async with worker.agent("assemble"):
                async for event in stream.noack().events():
                    await worker.on_rank_message(event)

        @app.agent(app.topic(topics.partials))
        async def merge_blocks(stream):
            async with worker.agent("merge_blocks"):
                async for event in stream.noack().events():
                    await worker.on_partial(event)

    if config.role != "all" or config.detail_inline:

        @app.agent(app.topic(topics.detail))
        async def assemble_detail(stream):
            async with worker.agent("assemble_detail"):
                async for event in stream.noack().events():
                    await worker.on_rank_message(event, detail=True)

    @app.timer(interval=1.0)
    async def tick() -> None:
        await worker.tick()

    @app.on_partitions_revoked.connect
    async def forget_offsets(*args: Any, **kwargs: Any) -> None:
        worker.gap_watch.forget()  # partitions may come back where another worker left them
        worker.detail_gap_watch.forget()
        worker.partials_gap_watch.forget()

    @app.on_partitions_assigned.connect
    async def begin_offsets(sender: Any, assigned: set[Any], **kwargs: Any) -> None:
        rank_topics = (topics.metrics, topics.detail, topics.partials)
        await worker.on_assigned(
            {t: [tp.partition for tp in assigned if tp.topic == t] for t in rank_topics}
        )

    @app.service
    class Shutdown(faust.Service):
        async def on_stop(self) -> None:
            try:
                await worker.release_ended()
            finally:
                worker.close()


def _stage2_agents(app: _App, worker: Worker, topics: TopicConfig) -> None:
    """On the store owner: reduced steps per run, run events, dead letters, evaluations and
    the timer that flushes a batch left waiting."""

    @app.agent(app.topic(topics.steps))
    async def per_run(stream):
        async with worker.agent("per_run"):
            async for event in stream.noack().events():
                await worker.on_reduced_step(event)

    @app.agent(app.topic(topics.detail_steps))
    async def store_detail(stream):
        async with worker.agent("store_detail"):
            async for event in stream.noack().events():
                await worker.on_detail_step(event)

    @app.agent(app.topic(topics.runs))
    async def run_events(stream):
        async with worker.agent("run_events"):
            async for event in stream.noack().events():
                await worker.on_run_event(event)

    @app.agent(app.topic(topics.deadletter))
    async def dead_letters(stream):
        async with worker.agent("dead_letters"):
            async for batch in stream.take(500, within=1.0):
                await worker.store_rows("dead_letters", [dead_letter_row(p) for p in batch])

    @app.agent(app.topic(topics.evals))
    async def evaluations(stream):
        async with worker.agent("evaluations"):
            async for batch in stream.take(500, within=1.0):
                rows = [r for r in map(_evaluation_row, batch) if r is not None]
                await worker.store_rows("evaluations", rows)
                await _page_evaluations(worker, rows)
                for row in rows:
                    progress = worker.heartbeat.runs.setdefault(row["run_id"], {"steps_written": 0})
                    progress["evals_written"] = progress.get("evals_written", 0) + 1

    @app.timer(interval=0.05)
    async def flush_old() -> None:
        """Write a batch that has waited ``stream.batch.within_s`` with no step after it."""
        worker.flush_soon()  # never awaits the write: the timer stays within its interval


async def _page_evaluations(worker: Worker, rows: list[dict[str, Any]]) -> None:
    """Each run's stored evaluations through its pipeline (``RunPipeline.on_evaluations``):
    a page leaves at once; its alert and anomaly rows and the run's state go with the next
    store batch."""
    for run_id in sorted({r["run_id"] for r in rows}):
        run = await worker.run_for(run_id)
        out = run.on_evaluations([r for r in rows if r["run_id"] == run_id])
        worker.batch.add(run_id, out)
        await worker.send_alerts(run_id, out)


def _highwater(app: faust.App, topic: str, partition: int) -> int | None:
    """The partition's high watermark as the consumer last saw it (None: not yet)."""
    try:
        return app.consumer.highwater(TP(topic, partition))
    except AssertionError:  # aiokafka: the partition is no longer assigned to this worker
        return None


def _evaluation_row(payload: bytes) -> dict[str, Any] | None:
    """An evaluator record as an ``evaluations`` row; a non-finite value is stored as NaN;
    None for a record that is not one."""
    try:
        record = json.loads(payload)
        value = record.get("value")
        row = {
            k: record[k]
            for k in (
                "run_id",
                "step",
                "tokens",
                "flops",
                "suite",
                "metric",
                "n_items",
                "weights_stream",
                "reference",
                "dataset_version",
                "tokenizer_version",
                "prompt_version",
                "decoding_version",
                "postprocess_version",
                "judge_version",
            )
            if k in record
        }
        row["value"] = float("nan") if value is None else float(value)
    except (ValueError, TypeError, AttributeError):
        return None
    return row if {"run_id", "step", "suite", "metric"} <= set(row) else None
