"""What the worker does with each message, apart from Faust: the agents in ``app`` are
short loops that call these methods, so the order of decode, validation, reduction,
publishing, processing, storing and acknowledging reads here, top-down.

Events are Faust events (``key``, ``value``, ``message.topic/partition/offset``,
``ack()``). A bad message becomes a dead letter with a reason; a failed publish or store
write is retried and its input stays unacknowledged; nothing raises out of a method the
timers call.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from probewire.instrument.plumbing import Heartbeat, TopicConfig
from probewire.instrument.wire import DecodeError, decode_rank_step, message_key
from probewire.sinks.clickhouse import ClickHouseSink, RejectedRows, StoreUnavailable
from probewire.sinks.retained import load_state, promote

from .alerting import AlertmanagerWebhook
from .assemble import BlockDone, StepAssembler
from .batching import Batch, StoreBatch
from .collector import IdleCollector
from .config import StreamConfig
from .fanin import MergeAssembler, decode_block, encode_block
from .gaps import GapReader, GapWatch
from .health import Progress
from .inputs import PER_RANK
from .lifecycle import EventError, parse_event
from .metrics import WorkerMetrics
from .publish import Publisher, PublishError
from .records import CompleteReason, RecordError, ReducedStep
from .split import OversizeStep, split_step, wire_parts
from .stage2 import RunPipeline, Stage2Output, detail_output
from .store import STATE_KEY, write_batch
from .validate import StepValidator

__all__ = ["Worker"]

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 256
"""Reduced steps stage 1 has handed to the broker and not yet seen confirmed; at this many
the agent waits (memory stays bounded while the broker is slow)."""

TIER_QUIET_S = 0.25
"""The step tier counts as busy this long after its last input or store write: a reduced
step confirmed by the broker but not yet fetched back by stage 2 is in no queue here."""


class Worker:
    """Stage 1, stage 2, dead letters and evaluations of one worker process."""

    def __init__(
        self,
        config: StreamConfig,
        topics: TopicConfig,
        make_publisher: Callable[[], Publisher],
        open_store: Callable[[], ClickHouseSink],
        heartbeat_path: Path,
        before_event: Callable[..., bool] = lambda agent, partition=None: False,
        make_gap_reader: Callable[[], GapReader] | None = None,
    ) -> None:
        self.config = config
        self.topics = topics
        self.make_publisher = make_publisher
        self.publisher: Publisher | None = None  # made in the worker process, on start
        self.make_gap_reader = make_gap_reader
        self.gaps: GapReader | None = None  # made on start, as the publisher
        self.gap_watch = GapWatch()
        self.detail_gap_watch = GapWatch()
        self.partials_gap_watch = GapWatch()
        self.publishing = asyncio.Event()
        self.open_store = open_store
        self.before_event = before_event  # a test hook (fault injection), a no-op otherwise
        self.assembler = StepAssembler(
            config.deadline_s, block_ranks=config.block_ranks, per_rank_names=PER_RANK
        )
        # a step's rank blocks, reduced here or by other workers, merged (``fanin``); its
        # deadline lies between the blocks' and the one stage 2 waits before a gap skip
        self.merger = MergeAssembler(
            (config.deadline_s + config.stage2.max_wait_s) / 2, config.block_ranks, PER_RANK
        )
        # the scan-tier detail (topic ``detail``), gathered apart: a step's page never waits
        # for it, and it is never dropped for being late (``CompleteReason.SCAN``)
        self.detail_assembler = StepAssembler(config.deadline_s, detail=True)
        self.validator = StepValidator(config.bounds)
        self.waiting: dict[tuple, list[Any]] = {}  # unacked rank messages per step (_wait_key)
        self.waiting_since: dict[tuple, float] = {}
        self.runs: dict[str, RunPipeline] = {}
        self.batch = StoreBatch(config.batch)
        self.progress = Progress(config.health)
        self.heartbeat = Heartbeat(heartbeat_path, "worker")
        self.webhook = AlertmanagerWebhook(config.alert_webhook_url)
        self.sink: ClickHouseSink | None = None
        self.detail_sink: ClickHouseSink | None = None  # the sink, its inserts at detail_nice
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="probewire-sink")
        # detail (``on_detail_step``) is decoded and written in a thread of its own: a P0
        # batch never queues behind it (the store serialises the inserts themselves, in
        # ``ClickHouseSink.batch_rows`` chunks)
        self._detail_writer = ThreadPoolExecutor(1, thread_name_prefix="probewire-detail")
        self._write_lock = asyncio.Lock()
        self._flushing: asyncio.Task | None = None  # the background write flush_soon started
        self._in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)  # reduced steps being confirmed
        self._unconfirmed: dict[asyncio.Task, tuple[int, float]] = {}  # (messages, since)
        self._tier_seen = 0.0  # monotonic: the step tier's last input or store write
        self._live: list[asyncio.Task] = []  # the heartbeat and the broker watch
        self.read_offsets: dict[tuple[str, int], int] = {}  # next offset to read, for lag
        self.highwater: Callable[[str, int], int | None] = lambda topic, partition: None
        self.healthy = True  # the last heartbeat's verdict
        self.lag: dict[tuple[str, int], int] = {}  # per partition, as of the last tick
        self.metrics = WorkerMetrics(self.metrics_snapshot)
        self.collector = IdleCollector(config.gc)  # the process's full collections, once started

    async def _in_writer(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    # -- start, agents, heartbeat -----------------------------------------------------------
    async def open(self) -> None:
        """Start the publisher; open the store (``open_store`` migrates it; retried while
        unavailable; a ``stage1`` worker has none); then ready."""
        self.publisher = self.make_publisher()
        self.publisher.on_retry = lambda reason: self.progress.failed("publish", reason)
        if self.make_gap_reader is not None:
            self.gaps = self.make_gap_reader()
        self._live = [asyncio.ensure_future(self._beat()), asyncio.ensure_future(self._watch())]
        self.metrics.serve(self.config.web_bind, self.config.metrics_port)
        self.publishing.set()
        if self.config.role != "all":
            self.write_heartbeat("ready")
            return
        self.progress.waiting("store", 1, time.monotonic())  # unhealthy after stall_s
        while self.sink is None:
            try:
                sink = await self._in_writer(self.open_store)
                self.detail_sink = dataclasses.replace(sink, nice=self.config.detail_nice)
                self.sink = sink
            except (StoreUnavailable, RejectedRows) as exc:
                self.progress.failed("store", str(exc))
                log.error("probewire: cannot open the store: %s; retrying", exc)
                await asyncio.sleep(2.0)
        self.progress.waiting("store", 0, None)
        self.progress.output("store")
        self.write_heartbeat("ready")

    @contextlib.asynccontextmanager
    async def agent(self, name: str) -> AsyncIterator[None]:
        """Around an agent's loop: a crash is recorded (and the heartbeat says so)."""
        self.progress.agent_started(name)
        try:
            yield
        except asyncio.CancelledError:
            self.progress.agent_stopped(name)
            raise
        except Exception as exc:  # recorded for health, then Faust's own handling
            self.progress.agent_crashed(name, exc)
            log.exception("probewire: agent %s crashed", name)
            self.write_heartbeat()
            raise
        self.progress.agent_stopped(name)

    def write_heartbeat(self, status: str | None = None) -> None:
        unconfirmed = self._unconfirmed.values()
        self.progress.waiting(
            "stage1",
            sum(map(len, self.waiting.values())) + sum(n for n, _ in unconfirmed),
            min([*self.waiting_since.values(), *(t for _, t in unconfirmed)], default=None),
        )
        self.progress.waiting("stage2", self.batch.waiting, self.batch.oldest_at)
        report = self.progress.report()
        self.healthy = report["healthy"]
        try:
            self.heartbeat.beat(status, report)
        except OSError as exc:
            log.error("probewire: cannot write the heartbeat %s: %s", self.heartbeat.path, exc)

    def _started_publisher(self) -> Publisher:
        """The publisher ``start`` made (every agent and timer runs after it)."""
        if self.publisher is None:
            raise RuntimeError("the worker's publisher is used before start()")
        return self.publisher

    async def _beat(self, interval_s: float = 1.0) -> None:
        """The heartbeat, every second, from the event loop itself (not a Faust timer,
        which waits for the group's first assignment): a loop that stops making progress
        (frozen, stopped, killed) leaves the file to go stale."""
        while True:
            self.write_heartbeat()
            await asyncio.sleep(interval_s)

    async def _watch(self, interval_s: float = 1.0, timeout_s: float = 2.0) -> None:
        """Ask the broker for its metadata every second; health is not ready while it does
        not answer (``HealthConfig.broker_s``). One line when it goes and when it is back."""
        loop = asyncio.get_running_loop()
        while True:
            error = await loop.run_in_executor(None, self._started_publisher().reachable, timeout_s)
            if bool(error) != bool(self.progress.broker_error):
                if error:
                    log.error("probewire: the broker does not answer: %s", error)
                else:
                    log.warning("probewire: the broker answers again")
            self.progress.broker(error)
            await asyncio.sleep(interval_s)

    def metrics_snapshot(self) -> tuple[dict, dict, int, bool]:
        """What ``/metrics`` shows (read from the metrics thread: copies only)."""
        stored = {r: int(p.get("steps_written", 0)) for r, p in list(self.heartbeat.runs.items())}
        return dict(self.lag), stored, self.progress.dead_letters, self.healthy

    def _measure_lag(self) -> None:
        """Each partition's high watermark less the next offset to read (on the loop)."""
        lag = {}
        for (topic, partition), next_offset in list(self.read_offsets.items()):
            high = self.highwater(topic, partition)
            if high is not None:
                lag[(topic, partition)] = high - next_offset
        self.lag = lag

    def _read(self, event: Any) -> None:
        """Note how far this worker has read a partition (``/metrics`` lag)."""
        message = event.message
        self.read_offsets[(message.topic, message.partition)] = message.offset + 1

    async def tick(self) -> None:
        """Once a second: a full garbage collection if due (``collector``: first, while the
        step tier may still be idle), steps past their deadline, idle runs, gap skips, the
        heartbeat."""
        if self.publisher is None:
            return
        self.collector.run(busy=self._paging_busy())
        now = time.monotonic()
        for reduced in self.assembler.expire(now) + self.detail_assembler.expire(now):
            await self.publish_step(reduced)
        for merged in self.merger.expire(now):
            await self.publish_step(merged, key=(merged.run_id, merged.step, "merge"))
        if self.sink is not None:
            for run_id, run in list(self.runs.items()):
                out = run.expire(now)
                if (
                    out.rows
                    or out.columns
                    or out.promote
                    or out.controls
                    or out.refused
                    or out.dead_letters
                ):
                    self.batch.add(run_id, out)
                    await self.send_alerts(run_id, out)
        self.flush_soon()
        self._measure_lag()
        self.write_heartbeat()

    # -- stage 1 ------------------------------------------------------------------------------
    async def on_assigned(self, assigned: Mapping[str, Iterable[int]]) -> None:
        """Partitions of the rank topics (step tier and detail) were assigned, still paused:
        every pending step is dropped, its messages left unacknowledged, since the consumer
        reads every assigned partition again from the group's committed offset, here or at
        a partition's new owner (``StepAssembler.drop_pending``); the offset the consumer
        reads each from, so a message skipped first is a gap too (``gaps``)."""
        dropped = self.assembler.drop_pending() + self.detail_assembler.drop_pending()
        dropped += [(*key, "merge") for key in self.merger.drop_pending()]
        for key in dropped:
            self.waiting.pop(key, None)
            self.waiting_since.pop(key, None)
        if self.gaps is None:
            return
        for topic, watch in (
            (self.topics.metrics, self.gap_watch),
            (self.topics.detail, self.detail_gap_watch),
            (self.topics.partials, self.partials_gap_watch),
        ):
            starts = await asyncio.get_running_loop().run_in_executor(
                None, self.gaps.starts, topic, sorted(assigned.get(topic, ()))
            )
            for partition, offset in starts.items():
                watch.begin(partition, offset)

    async def on_rank_message(self, event: Any, detail: bool = False) -> None:
        """Read first what the consumer skipped before this message (``gaps``), then this
        message: decode, validate, gather; publish each step its message completes.
        ``detail``: a message of the detail topic (scan-tier points, ring dumps)."""
        message = event.message
        self._read(event)
        if self.before_event("assemble", message.partition):  # a test's fault: as if the
            event.ack()  # consumer skipped this one
            return
        await self.publishing.wait()
        watch = self.detail_gap_watch if detail else self.gap_watch
        skipped = watch.gap(message.partition, message.offset)
        if skipped is not None and self.gaps is not None:
            for missed in await asyncio.get_running_loop().run_in_executor(
                None, self.gaps.read, message.topic, message.partition, *skipped
            ):
                log.warning(
                    "rank message at partition %d offset %d read again by offset "
                    "(the consumer skipped it)",
                    message.partition,
                    missed.message.offset,
                )
                await self._gather(missed, detail)
        await self._gather(event, detail)

    async def _gather(self, event: Any, detail: bool = False) -> None:
        if not detail:
            self._tier_seen = time.monotonic()
        try:
            record = decode_rank_step(event.key, event.value)
        except DecodeError as exc:
            await self.dead_letter(event, exc.reason)
            event.ack()
            return
        checked = self.validator.check(record)
        if checked.reason is not None:
            await self.dead_letter(event, checked.reason)
        assembler = self.detail_assembler if detail else self.assembler
        if checked.record is None:
            event.ack()
            if self.validator.world_size(record.run_id) == record.world_size:
                # its step does not wait for this rank: reduced without it (ranks_missing)
                for reduced in assembler.refused(record):
                    await self.publish_step(reduced)
            return
        now = time.monotonic()
        result = assembler.add(record, now, event.message.partition)
        reason = _reason(record.replay, detail)
        key = assembler.key(record) if reason is None else (record.run_id, record.step, reason)
        if result.duplicate:
            held = self.waiting.get(key)
            if held is None:
                event.ack()
            else:  # its step is still gathering: acknowledged with it, so that no commit
                held.append(event)  # passes this offset (the same one, re-read) before then
            return
        if result.late is not None:
            log.warning(
                "late data: run %s step %d rank %d (partition %d offset %d) arrived "
                "after its step was reduced",
                record.run_id,
                record.step,
                record.rank,
                event.message.partition,
                event.message.offset,
            )
            late = ReducedStep(
                run_id=record.run_id,
                step=record.step,
                world_size=record.world_size,
                ranks_reporting=[record.rank],
                ranks_missing=[],
                reduced={},
                per_rank={record.rank: record.values},
                hosts={record.rank: record.host},
                complete_reason=CompleteReason.LATE,
            )
            late_key = (record.run_id, record.step, CompleteReason.LATE)
            self.waiting.setdefault(late_key, []).append(event)
            await self.publish_step(late, key=late_key)
            return
        self.waiting.setdefault(key, []).append(event)
        self.waiting_since.setdefault(key, now)
        for reduced in result.completed:
            if isinstance(reduced, ReducedStep) and reduced.ranks_missing:
                log.warning(
                    "run %s step %d reduced (%s) without ranks %s; closed at partition "
                    "%d offset %d by step %d rank %d",
                    reduced.run_id,
                    reduced.step,
                    reduced.complete_reason,
                    reduced.ranks_missing[:20],
                    event.message.partition,
                    event.message.offset,
                    record.step,
                    record.rank,
                )
            await self.publish_step(reduced)

    async def publish_step(self, reduced: ReducedStep | BlockDone, key: Any = None) -> None:
        """Hand a reduced step to the broker and return: the agent goes on with the next
        message while the broker confirms (one round trip per step bounded stage 1 at
        ~120 steps/s). Up to ``MAX_IN_FLIGHT`` steps wait for confirmation at once."""
        if key is None:
            if isinstance(reduced, BlockDone):
                key = (reduced.run_id, reduced.step, "block", reduced.partial.block)
            else:
                key = _wait_key(reduced.run_id, reduced.step, reduced.complete_reason)
        events = self.waiting.pop(key, [])
        since = self.waiting_since.pop(key, time.monotonic())
        await self._in_flight.acquire()
        task = asyncio.ensure_future(self._deliver(reduced, events))
        self._unconfirmed[task] = (len(events), since)  # still waiting, for health
        task.add_done_callback(self._unconfirmed.pop)

    def _messages(self, item: ReducedStep | BlockDone) -> list[tuple[str, bytes, bytes]]:
        """(topic, key, value) of a reduced step (``wire_parts``: split to fit the message
        limit, its detail to the detail topic keyed run:step, the rest to stage 2 keyed by
        run), or of a reduced rank block: its ranks' values as detail parts, then its
        partial state for the merge (``fanin``)."""
        run, at = item.run_id.encode(), message_key(item.run_id, item.step)
        limit = self.config.max_message_bytes
        if isinstance(item, ReducedStep):
            return [
                (self.topics.detail_steps, at, data) if detail else (self.topics.steps, run, data)
                for detail, data in wire_parts(item, limit)
            ]
        self.note_block(item)
        detail = [
            (self.topics.detail_steps, at, data) for _, data in split_step(item.detail, limit)
        ]
        partial = encode_block(item.partial, item.complete)
        if len(partial) > limit:
            raise OversizeStep(
                f"block {item.partial.block} of step {item.step} of run {item.run_id!r}: "
                f"{len(partial)} bytes, over stream.max_message_bytes={limit} (lower "
                "stream.block_ranks and the ranks' ProbeConfig.block_ranks)"
            )
        return [*detail, (self.topics.partials, message_key(item.run_id, item.step), partial)]

    def note_block(self, item: BlockDone) -> None:
        """Count a rank block reduced here, and the newest steps it belonged to (the
        heartbeat shows which workers reduced parts of which steps)."""
        run = self.heartbeat.runs.setdefault(item.run_id, {"steps_written": 0})
        run["blocks_reduced"] = run.get("blocks_reduced", 0) + 1
        steps = run.setdefault("block_steps", [])
        if item.step not in steps:
            steps.append(item.step)
            del steps[:-64]

    async def _deliver(self, reduced: ReducedStep | BlockDone, events: list[Any]) -> None:
        """Publish the step or rank block (``_messages``), then acknowledge the messages
        behind it; one that can never be published is dead-lettered. Unconfirmed, nothing
        is acknowledged: a restart reads it again."""
        try:
            try:
                for topic, key, data in self._messages(reduced):
                    await self._started_publisher().send(topic, key, data)
            except (OversizeStep, PublishError) as exc:
                reason = str(exc)
                log.error(
                    "probewire: step %d of run %s not published: %s",
                    reduced.step,
                    reduced.run_id,
                    reason,
                )
                for event in events:
                    await self.dead_letter(event, f"reduced step not published: {reason}")
            for event in events:
                event.ack()
            self.progress.output("stage1")
        except Exception as exc:  # a bug: the step's messages stay unacknowledged
            log.exception(
                "probewire: step %d of run %s: delivery failed", reduced.step, reduced.run_id
            )
            self.progress.failed("stage1", f"delivery of step {reduced.step} failed: {exc}")
        finally:
            self._in_flight.release()

    # -- stage 2 ------------------------------------------------------------------------------
    async def on_partial(self, event: Any) -> None:
        """A rank block's partial state (``fanin``): merged with its step's other blocks,
        the step is published as if one worker had reduced every rank message; the
        partials are acknowledged once it is confirmed."""
        message = event.message
        self._read(event)
        await self.publishing.wait()
        skipped = self.partials_gap_watch.gap(message.partition, message.offset)
        missed = []
        if skipped is not None and self.gaps is not None:
            missed = await asyncio.get_running_loop().run_in_executor(
                None, self.gaps.read, message.topic, message.partition, *skipped
            )
        self._tier_seen = time.monotonic()
        for item in [*missed, event]:
            try:
                partial, complete = decode_block(item.value)
            except RecordError as exc:
                await self.dead_letter(item, exc.reason)
                item.ack()
                continue
            merged, repeated = self.merger.add(partial, complete, time.monotonic())
            key = (partial.run_id, partial.step, "merge")
            if repeated and key not in self.waiting:
                item.ack()  # its step was merged: a re-delivery, or a block after the merge
                continue
            self.waiting.setdefault(key, []).append(item)
            self.waiting_since.setdefault(key, time.monotonic())
            for step in merged:
                await self.publish_step(step, key=key)

    async def on_reduced_step(self, event: Any) -> None:
        """Process a reduced step for its run; its message is acknowledged once stored."""
        self.before_event("per_run")
        self._read(event)
        self._tier_seen = time.monotonic()
        await self.publishing.wait()
        while self.sink is None or self.batch.full:
            await asyncio.sleep(0.05)
            await self.flush_if_due()
        try:
            reduced = ReducedStep.from_bytes(event.value)
        except RecordError as exc:
            await self.dead_letter(event, exc.reason)
            event.ack()
            return
        run = await self.run_for(reduced.run_id)
        out = run.accept(reduced, time.monotonic())
        self.batch.add(reduced.run_id, out, event)  # same loop step as accept: state == batch
        await self.send_alerts(reduced.run_id, out)
        await self.flush_if_due()

    def _paging_busy(self) -> bool:
        """The step tier has work in hand: a step gathering or merging, a reduced step not
        yet confirmed by the broker, rows waiting for the store, or any of it less than
        ``TIER_QUIET_S`` ago."""
        return bool(
            self.assembler.pending
            or self.merger.pending
            or self._unconfirmed
            or self.batch.waiting
            or time.monotonic() - self._tier_seen < TIER_QUIET_S
        )

    async def _detail_turn(self) -> None:
        """Wait while the step tier has work in hand, at most ``detail_yield_s``."""
        held = time.monotonic() + self.config.detail_yield_s
        while self.sink is None or (self._paging_busy() and time.monotonic() < held):
            await asyncio.sleep(0.01)

    async def _store_detail(self, step: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the detail writer thread, on the step tier's turn; retried every
        second while the store is down."""
        while True:
            await self._detail_turn()
            try:
                return await asyncio.get_running_loop().run_in_executor(
                    self._detail_writer, fn, *args
                )
            except (StoreUnavailable, RejectedRows) as exc:
                self.progress.failed("detail", str(exc))
                log.error("probewire: detail of step %d not stored (%s); retrying", step, exc)
                await asyncio.sleep(1.0)

    async def on_detail_step(self, event: Any) -> None:
        """Detail from the detail topic (``split.wire_parts``), stored apart from the ordered
        per-run path so that no page waits for it: decoded into look-back rows, then written
        one table at a time, each of these on the step tier's turn (``_detail_turn``: while
        it has no work in hand, or after ``detail_yield_s`` anyway, so detail never starves)
        in the detail writer thread (the event loop goes on reducing and paging meanwhile);
        into the detail tables too if its step was kept already (``RunPipeline.detail_kept``),
        promoted if it was kept while they were written (a step kept after that promotes
        them itself); then acknowledged. A store that is down is retried, the message
        unacknowledged."""
        self._read(event)
        await self.publishing.wait()
        await self._detail_turn()
        loop = asyncio.get_running_loop()
        try:
            item, out = await loop.run_in_executor(self._detail_writer, _detail, event.value)
        except RecordError as exc:
            await self.dead_letter(event, exc.reason)
            event.ack()
            return
        run = await self.run_for(item.run_id)
        named = run.tensor_names(out)
        out.rows["tensor_names"] += named
        kept = run.detail_kept(item)
        if kept:  # its step was kept before: its rows go to the detail tables too, at once
            out.retain_detail()
        rejected = []
        for part in _by_table(out):  # a turn each: a step arriving meanwhile goes first
            batch = Batch(outputs={item.run_id: part})
            rejected += await self._store_detail(item.step, write_batch, self.detail_sink, batch)
        if not kept and run.detail_kept(item):  # kept while the rows were written
            await self._store_detail(item.step, promote, self.detail_sink, item.run_id, [item.step])
        run.tensors.update(row["tensor"] for row in named)  # their rows are stored now
        for run_id, row, reason in rejected:
            await self.dead_letter_row(run_id, row, reason)
        event.ack()
        self.progress.output("detail")

    async def on_run_event(self, event: Any) -> None:
        """A run's lifecycle event (``stream.lifecycle``): its ``runs`` row goes with the
        next store batch; the event is acknowledged once that is written."""
        await self.publishing.wait()
        while self.sink is None or self.batch.full:
            await asyncio.sleep(0.05)
            await self.flush_if_due()
        try:
            parsed = parse_event(event.value)
        except EventError as exc:
            await self.dead_letter(event, exc.reason)
            event.ack()
            return
        run = await self.run_for(parsed.run_id)
        self.batch.add(parsed.run_id, run.on_event(parsed), event)
        await self.flush_if_due()

    async def run_for(self, run_id: str) -> RunPipeline:
        """The run's pipeline, resumed from its saved state (the store retried until up)."""
        while run_id not in self.runs:
            try:
                state = await self._in_writer(load_state, self.sink, run_id, STATE_KEY)
            except (StoreUnavailable, RejectedRows) as exc:
                self.progress.failed("stage2", f"loading state of run {run_id}: {exc}")
                await asyncio.sleep(1.0)
                continue
            if run_id not in self.runs:
                self.runs[run_id] = (
                    RunPipeline(run_id, self.config.stage2)
                    if state is None
                    else RunPipeline.from_state(run_id, self.config.stage2, state, time.monotonic())
                )
        return self.runs[run_id]

    async def send_alerts(self, run_id: str, out: Stage2Output) -> None:
        """Alerts and control messages leave at once (a restart may repeat one, never lose);
        steps stage 2 refused, or stored with something their ranks disagree on, become
        dead letters."""
        for _, reason in out.refused + out.dead_letters:
            await self._send_dead_letter(
                run_id.encode(),
                {"reason": reason, **_origin("stage2", reason.encode()), "payload_b64": ""},
            )
        alerts = out.rows.get("alerts", [])
        try:
            for alert in alerts:
                await self._started_publisher().send(
                    self.topics.alerts, run_id.encode(), json.dumps(alert).encode()
                )
            for control in out.controls:
                await self._started_publisher().send(
                    self.topics.control, run_id.encode(), json.dumps(control).encode()
                )
        except PublishError as exc:  # the alert row is still stored with the batch
            log.error("probewire: alert of run %s not published: %s", run_id, exc.reason)
        if alerts:
            asyncio.get_running_loop().run_in_executor(None, self.webhook.post, alerts)

    async def flush_if_due(self) -> None:
        if self.batch.due():
            await self.flush()

    def flush_soon(self) -> asyncio.Task | None:
        """Start writing a due batch in the background (one write at a time) and return at
        once: a timer that awaited the store write ran longer than its own interval, and
        mode logged "Timer ... is overlapping" at every slow write."""
        if not self.batch.due() or (self._flushing is not None and not self._flushing.done()):
            return None
        self._flushing = asyncio.ensure_future(self.flush())
        return self._flushing

    async def flush(self) -> None:
        """Write the batch: rows, promotions, states; dead-letter rows the store refuses;
        then acknowledge. A failed write is retried later, its messages unacknowledged."""
        async with self._write_lock:
            if self.sink is None:
                return
            batch = self.batch.take(lambda r: (self.runs[r].last_step, self.runs[r].to_state()))
            if batch is None:
                return
            try:
                started = time.monotonic()
                rejected = await self._in_writer(write_batch, self.sink, batch)
                self.metrics.write_seconds.observe(time.monotonic() - started)
            except (StoreUnavailable, RejectedRows) as exc:
                delay = self.batch.failed(batch, str(exc))
                self.progress.failed("stage2", str(exc))
                log.error(
                    "probewire: store write of %d step(s) failed (%s); retrying in %.1fs",
                    len(batch.acks),
                    exc,
                    delay,
                )
                return
            self._tier_seen = time.monotonic()
            refused = {id(row) for _, row, _ in rejected}
            for run_id, row, reason in rejected:
                await self.dead_letter_row(run_id, row, reason)
            for ack in self.batch.written(batch):
                ack.ack()
            self.progress.output("stage2", len(batch.acks))
            for run_id, out in batch.outputs.items():
                run = self.runs[run_id]
                progress = self.heartbeat.runs.setdefault(run_id, {"steps_written": 0})
                stored = [r for r in out.rows.get("step_metrics", ()) if id(r) not in refused]
                # steps stored, not attempted; a row joined by its scan step counted once
                progress["steps_written"] += len(stored) - out.rewrites
                progress["last_step"] = run.last_step
                progress["finished"] = run.finished
                progress["status"] = run.status()
                progress["alerts"] = progress.get("alerts", 0) + len(out.rows.get("alerts", []))
        self.write_heartbeat()

    # -- dead letters and evaluations ------------------------------------------------------
    async def dead_letter(self, event: Any, reason: str) -> None:
        payload = event.value if isinstance(event.value, bytes) else b""
        limit = self.config.max_message_bytes // 2  # base64 and the envelope must fit
        body = {
            "reason": reason,
            "topic": event.message.topic,
            "partition": event.message.partition,
            "offset": event.message.offset,
            "payload_b64": base64.b64encode(payload[:limit]).decode(),
            "truncated": len(payload) > limit,
        }
        await self._send_dead_letter(event.key, body)

    async def dead_letter_row(self, run_id: str, row: Any, reason: str) -> None:
        text = json.dumps(row, default=str).encode()
        reason = f"store refused a row: {reason}"
        await self._send_dead_letter(
            run_id.encode(),
            {
                "reason": reason,
                **_origin("store", run_id.encode() + text),
                "payload_b64": base64.b64encode(text).decode(),
            },
        )

    async def _send_dead_letter(self, key: bytes | None, body: dict[str, Any]) -> None:
        self.progress.dead_letter()
        body["key"] = (key or b"").decode(errors="replace")  # run and step, for the store
        try:
            await self._started_publisher().send(
                self.topics.deadletter, key, json.dumps(body).encode()
            )
        except PublishError as exc:
            log.error("probewire: dead letter not published (%s): %s", exc.reason, body["reason"])

    async def store_rows(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Rows of the dead-letter or evaluation agents, retried while the store is down."""
        while self.sink is None:
            await asyncio.sleep(0.1)
        while True:
            try:
                refused = await self._in_writer(self.sink.write_or_reject, table, rows)
                break
            except StoreUnavailable as exc:
                self.progress.failed(table, str(exc))
                await asyncio.sleep(1.0)
        for row, reason in refused:
            log.error("probewire: %s row refused by the store (%s): %s", table, reason, row)
        self.progress.output(table, len(rows))

    async def release_ended(self) -> None:
        """At shutdown, before ``close``: the runs that said they ended keep their final
        steps' detail (``RunPipeline.at_shutdown``), written with what the batch holds."""
        if self.sink is None:
            return
        released = False
        for run_id, run in list(self.runs.items()):
            out = run.at_shutdown()
            if out.promote:
                self.batch.add(run_id, out)
                released = True
        if released:
            await self.flush()

    def close(self) -> None:
        for task in self._live:
            task.cancel()
        left = self.publisher.close() if self.publisher is not None else 0
        if left:
            log.error("probewire: %d message(s) not delivered at shutdown (inputs unacked)", left)
        if self.gaps is not None:
            self.gaps.close()
        self._writer.shutdown(wait=True)
        self._detail_writer.shutdown(wait=True)


def _by_table(out: Stage2Output) -> list[Stage2Output]:
    """``out``'s column batches and rows, one table each (promotions are not carried)."""
    tables = [Stage2Output(columns={t: c}) for t, c in out.columns.items()]
    return tables + [Stage2Output(rows=defaultdict(list, {t: r})) for t, r in out.rows.items() if r]


def _detail(payload: bytes) -> tuple[ReducedStep, Stage2Output]:
    """A detail message and its look-back rows (in the detail writer thread)."""
    item, matrix = ReducedStep.detail_from_bytes(payload)
    return item, detail_output(item, matrix)


def _reason(replay: bool, detail: bool) -> CompleteReason | None:
    """The reason a rank message's reduced step will carry, where it is not the step's own
    (its wait key's third part)."""
    if replay:
        return CompleteReason.REPLAY
    return CompleteReason.SCAN if detail else None


def _wait_key(run_id: str, step: int, reason: CompleteReason | str | None) -> tuple:
    """The key of the rank messages waiting for one reduced step: a replay (the ranks' ring
    buffers) and a scan-tier detail step wait apart from the step's own messages."""
    if reason in (CompleteReason.REPLAY, CompleteReason.SCAN):
        return (run_id, step, reason)
    return (run_id, step)


def _origin(what: str, content: bytes) -> dict[str, Any]:
    """Where a dead letter that no input message carries comes from: ``what`` as its topic
    and a hash of its content as its offset, so two letters never share the store's key
    (topic, partition, offset) and the same letter sent twice is stored once."""
    digest = hashlib.blake2b(content, digest_size=8).digest()
    return {"topic": what, "partition": 0, "offset": int.from_bytes(digest, "big")}


def dead_letter_row(payload: bytes) -> dict[str, Any]:
    """A dead-letter message as a ``dead_letters`` row (unreadable ones kept as they are)."""
    try:
        body = json.loads(payload)
        if not isinstance(body, dict):
            raise TypeError("not an object")
        return {
            "topic": str(body.get("topic", "")),
            "partition": int(body.get("partition", 0)),
            "offset": int(body.get("offset", 0)),
            "key": str(body.get("key", "")),
            "reason": str(body.get("reason", "")),
            "payload_b64": str(body.get("payload_b64", "")),
        }
    except (ValueError, TypeError) as exc:
        return {
            "topic": "",
            "partition": 0,
            "offset": 0,
            "key": "",
            "reason": f"unreadable dead letter: {exc}",
            "payload_b64": base64.b64encode(payload or b"").decode(),
        }
