"""The Faust app: topics wired to small agents; the math lives in pure modules.

    otlp_metrics ──assemble──► probewire.steps ──per_run──► ClickHouse (+ probewire.alerts,
         │   (stage 1, key run:step)            (stage 2, key run_id)     probewire.control,
         └──► probewire.deadletter ──dead_letters──► ClickHouse            Alertmanager webhook)
    probewire.evals ──evaluations──► ClickHouse

Delivery is at-least-once and every write is idempotent:
- stage 1 acknowledges a rank message only once its step has been published, so a step
  pending at a crash is re-assembled from re-delivered messages;
- stage 2 writes rows, promotes retained detail and saves the run's state in ClickHouse
  before Faust acknowledges the batch; on restart the state is loaded and re-delivered
  steps at or before the saved position are skipped.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import faust
from aiokafka.helpers import create_ssl_context

from probewire.deploy.health import Heartbeat
from probewire.instrument.wire import DecodeError, decode_rank_step
from probewire.deploy.settings import KafkaSettings, Settings
from probewire.sinks.clickhouse import ClickHouseSink, connect
from probewire.sinks.retained import load_state, promote, save_state

from .alerting import AlertmanagerWebhook
from .assemble import StepAssembler
from .records import ReducedStep
from .signals import DetectorConfig
from .stage2 import RunPipeline, Stage2Config, Stage2Output

__all__ = ["broker_credentials", "create_app", "stage2_config"]

log = logging.getLogger(__name__)


def broker_credentials(kafka: KafkaSettings) -> faust.types.auth.CredentialsT | None:
    """Faust's (aiokafka's) credentials for the cluster the confluent clients reach with
    ``kafka.client_config()``: TLS with the CA of ``ssl_ca_location`` (system CAs when
    empty), SASL PLAIN / SCRAM with the password from its environment variable."""
    ssl_context = None
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        ssl_context = create_ssl_context(cafile=kafka.ssl_ca_location or None)
    if kafka.security_protocol.startswith("SASL"):
        return faust.SASLCredentials(username=kafka.sasl_username,
                                     password=kafka.sasl_password(),
                                     mechanism=kafka.sasl_mechanism, ssl_context=ssl_context)
    return faust.SSLCredentials(ssl_context) if ssl_context is not None else None


def stage2_config(settings: Settings) -> Stage2Config:
    s = settings.stream
    return Stage2Config(
        detectors=DetectorConfig(
            window=s.detector_window, loss_z=s.loss_z_threshold, grad_z=s.grad_z_threshold,
            signal_z=s.signal_z_threshold, straggler_ratio=s.straggler_ratio,
            straggler_steps=s.straggler_steps, clip_threshold=s.clip_threshold,
            clip_window=s.clip_window, memory_growth=s.memory_growth,
            maxvio_threshold=s.maxvio_threshold, maxvio_steps=s.maxvio_steps,
            media_scale_min=s.media_scale_min,
            residual_ratio_min=s.residual_ratio_min, rearm_steps=s.rearm_steps),
        retention_every_k=s.retention_every_k, retention_halo=s.retention_halo,
        warmup_steps=s.warmup_steps, final_steps=s.final_steps,
        max_wait_s=s.deadline_s + 10.0, run_idle_s=s.run_idle_s)


def _set_fetch_wait(ms: int) -> None:
    """Faust hard-codes aiokafka's ``fetch_max_wait_ms=1500``. Tansu (measured) answers a
    waiting fetch only at that deadline even when data arrives, adding up to 1.5 s per hop;
    a short wait costs a few idle fetches per second instead. Applies to this process."""
    import aiokafka

    base = getattr(aiokafka.AIOKafkaConsumer, "_probewire_base", aiokafka.AIOKafkaConsumer)

    class Consumer(base):  # type: ignore[misc, valid-type]
        _probewire_base = base

        def __init__(self, *topics: str, **kwargs: Any) -> None:
            kwargs["fetch_max_wait_ms"] = ms
            super().__init__(*topics, **kwargs)

    aiokafka.AIOKafkaConsumer = Consumer


def create_app(settings: Settings, heartbeat_path: Path) -> faust.App:
    """Build the worker's app from one settings tree (decided once, here)."""
    _set_fetch_wait(settings.stream.fetch_max_wait_ms)
    topics = settings.topics
    app = faust.App(
        settings.stream.app_id,
        broker=f"kafka://{settings.kafka.bootstrap}",
        broker_credentials=broker_credentials(settings.kafka),
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
        # the worker keeps no Faust tables (state lives in ClickHouse), but Faust creates its
        # data directory anyway: next to the heartbeat file, never in the working directory
        datadir=str(heartbeat_path.parent / "faust-{conf.id}"),
    )
    metrics_topic = app.topic(topics.metrics)
    steps_topic = app.topic(topics.steps)
    deadletter_topic = app.topic(topics.deadletter)
    alerts_topic = app.topic(topics.alerts)
    control_topic = app.topic(topics.control)
    evals_topic = app.topic(topics.evals)

    config = stage2_config(settings)
    assembler = StepAssembler(settings.stream.deadline_s)
    waiting: dict[tuple[str, int], list[Any]] = defaultdict(list)  # unacked events per step
    runs: dict[str, RunPipeline] = {}
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probewire-sink")
    sink: list[ClickHouseSink] = []  # opened in the worker process, on start
    webhook = AlertmanagerWebhook(settings.stream.alert_webhook_url)
    heartbeat = Heartbeat(heartbeat_path, "worker")

    async def in_writer(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(writer, fn, *args)

    async def publish(reduced: ReducedStep) -> None:
        """Publish a reduced step, then acknowledge the rank messages it consumed.

        Acknowledging after the send is enqueued is safe: Faust flushes the producer before
        it commits offsets, so an offset is never committed ahead of the step it produced.
        """
        await steps_topic.send(key=reduced.run_id.encode(), value=reduced.to_bytes())
        for event in waiting.pop((reduced.run_id, reduced.step), []):
            event.ack()

    async def dead_letter(event, reason: str) -> None:
        body = {"reason": reason, "topic": event.message.topic,
                "partition": event.message.partition, "offset": event.message.offset,
                "payload_b64": base64.b64encode(event.value or b"").decode()}
        await deadletter_topic.send(key=event.key, value=json.dumps(body).encode())

    @app.task
    async def open_store() -> None:
        ch = settings.clickhouse
        client = connect(ch.url, username=ch.username, password_env=ch.password_env)
        store = ClickHouseSink(client, ch.database, ch.retry_max_s)
        await in_writer(lambda: store.migrate(sensitive_artifacts=ch.sensitive_artifacts,
                                              sensitive_ttl_days=ch.sensitive_ttl_days))
        sink.append(store)
        heartbeat.beat("ready")

    @app.agent(metrics_topic)
    async def assemble(stream):
        async for event in stream.noack().events():
            try:
                record = decode_rank_step(event.key, event.value)
            except DecodeError as exc:
                await dead_letter(event, exc.reason)
                event.ack()
                continue
            result = assembler.add(record, time.monotonic(), event.message.partition)
            if result.duplicate:
                event.ack()
                continue
            if result.late is not None:
                log.warning("late data: run %s step %d rank %d (partition %d offset %d) "
                            "arrived after its step was reduced", record.run_id, record.step,
                            record.rank, event.message.partition, event.message.offset)
                late = ReducedStep(run_id=record.run_id, step=record.step,
                                   world_size=record.world_size, ranks_reporting=[record.rank],
                                   ranks_missing=[], reduced={},
                                   per_rank={record.rank: record.values},
                                   hosts={record.rank: record.host}, complete_reason="late")
                await steps_topic.send(key=record.run_id.encode(), value=late.to_bytes())
                event.ack()
                continue
            waiting[(record.run_id, record.step)].append(event)
            for reduced in result.completed:
                if reduced.ranks_missing:
                    log.warning("run %s step %d reduced (%s) without ranks %s; closed at "
                                "partition %d offset %d by step %d rank %d", reduced.run_id,
                                reduced.step, reduced.complete_reason, reduced.ranks_missing,
                                event.message.partition, event.message.offset, record.step,
                                record.rank)
                await publish(reduced)

    async def run_for(run_id: str) -> RunPipeline:
        """The run's pipeline, resumed from its saved state after a restart."""
        if run_id not in runs:
            state = await in_writer(load_state, sink[0], run_id, "stage2")
            runs[run_id] = RunPipeline(run_id, config) if state is None else \
                RunPipeline.from_state(run_id, config, state, time.monotonic())
        return runs[run_id]

    # Stage 2 output waiting for the store: alerts leave at once, rows are written in
    # batches (one insert per table costs ~5 ms however small), and the step messages behind
    # them are acknowledged only once written, so a crash re-delivers what was not stored.
    unwritten: dict[str, Stage2Output] = defaultdict(Stage2Output)
    unacked: list[Any] = []
    oldest_at: float | None = None  # when the oldest unwritten output arrived
    write_lock = asyncio.Lock()

    async def send_alerts(run_id: str, out: Stage2Output) -> None:
        for alert in out.rows.get("alerts", []):
            await alerts_topic.send(key=run_id.encode(), value=json.dumps(alert).encode())
        for control in out.controls:
            await control_topic.send(key=run_id.encode(), value=json.dumps(control).encode())
        if out.rows.get("alerts"):
            asyncio.get_running_loop().run_in_executor(None, webhook.post, out.rows["alerts"])

    async def stage(run_id: str, out: Stage2Output, event: Any = None) -> None:
        """Alerts out now; rows join the next store batch (written when it is full or old)."""
        nonlocal oldest_at
        await send_alerts(run_id, out)
        if out.rows or out.promote:
            unwritten[run_id].extend(out)
        if event is not None:
            unacked.append(event)
        if oldest_at is None:
            oldest_at = time.monotonic()
        if len(unacked) >= settings.stream.batch_steps or \
                time.monotonic() - oldest_at >= settings.stream.batch_within_s:
            await write_batch()

    async def write_batch() -> None:
        """Rows, promotion of retained detail and state, in that order, in one thread; then
        acknowledge the steps behind them. A crash in between can only repeat an alert (it
        is re-derived from re-delivered steps), never lose one."""
        nonlocal oldest_at
        async with write_lock:
            if not unwritten and not unacked:
                oldest_at = None
                return
            outputs, events = dict(unwritten), list(unacked)
            unwritten.clear()
            unacked.clear()
            oldest_at = None
            states = {run_id: (runs[run_id].last_step, runs[run_id].to_state())
                      for run_id in outputs}

            def write() -> None:
                store = sink[0]
                for run_id, out in outputs.items():
                    for table, rows in out.rows.items():
                        store.write(table, rows)
                    promote(store, run_id, sorted(set(out.promote)))
                    save_state(store, run_id, "stage2", *states[run_id])
            await in_writer(write)
            for event in events:
                event.ack()
            for run_id, out in outputs.items():
                progress = heartbeat.runs.setdefault(run_id, {"steps_written": 0})
                progress["steps_written"] += len(out.rows.get("step_metrics", []))
                progress["last_step"] = runs[run_id].last_step
                progress["finished"] = runs[run_id].finished
                progress["alerts"] = progress.get("alerts", 0) + len(out.rows.get("alerts", []))
            heartbeat.beat()

    @app.agent(steps_topic)
    async def per_run(stream):
        async for event in stream.noack().events():
            while not sink:
                await asyncio.sleep(0.1)
            reduced = ReducedStep.from_bytes(event.value)
            run = await run_for(reduced.run_id)
            await stage(reduced.run_id, run.accept(reduced, time.monotonic()), event)

    @app.timer(interval=0.05)
    async def flush_old() -> None:
        """Write a batch that has waited ``stream.batch_within_s`` with no step after it."""
        if oldest_at is not None and \
                time.monotonic() - oldest_at >= settings.stream.batch_within_s:
            await write_batch()

    @app.timer(interval=1.0)
    async def deadlines() -> None:
        now = time.monotonic()
        for reduced in assembler.expire(now):
            await publish(reduced)
        if sink:
            for run_id, run in runs.items():
                out = run.expire(now)
                if out.rows or out.promote or out.controls:
                    await stage(run_id, out)
        heartbeat.beat()

    @app.agent(deadletter_topic)
    async def dead_letters(stream):
        async for batch in stream.take(500, within=1.0):
            while not sink:
                await asyncio.sleep(0.1)
            rows = []
            for payload in batch:
                body = json.loads(payload)
                rows.append({"topic": body.get("topic", ""), "partition": body.get("partition", 0),
                             "offset": body.get("offset", 0), "key": "",
                             "reason": body.get("reason", ""),
                             "payload_b64": body.get("payload_b64", "")})
            await in_writer(sink[0].write, "dead_letters", rows)

    @app.agent(evals_topic)
    async def evaluations(stream):
        async for batch in stream.take(500, within=1.0):
            while not sink:
                await asyncio.sleep(0.1)
            rows = [r for r in (_evaluation_row(json.loads(p)) for p in batch) if r is not None]
            await in_writer(sink[0].write, "evaluations", rows)
            for row in rows:
                progress = heartbeat.runs.setdefault(row["run_id"], {"steps_written": 0})
                progress["evals_written"] = progress.get("evals_written", 0) + 1
            heartbeat.beat()

    return app


def _evaluation_row(record: dict[str, Any]) -> dict[str, Any] | None:
    """An evaluator record as an ``evaluations`` row; a non-finite value is stored as NaN."""
    value = record.get("value")
    row = {k: record[k] for k in (
        "run_id", "step", "tokens", "flops", "suite", "metric", "n_items", "weights_stream",
        "reference", "dataset_version", "tokenizer_version", "prompt_version",
        "decoding_version", "postprocess_version", "judge_version") if k in record}
    row["value"] = float("nan") if value is None else float(value)
    return row if {"run_id", "step", "suite", "metric"} <= set(row) else None
