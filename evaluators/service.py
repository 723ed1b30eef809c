"""``probewire evaluator``: checkpoints in, eval records out, off the training path.

    probewire.checkpoints --(parse, cadence, load, suites)--> probewire.evals      (key run_id)
                          \\--(malformed / failed)---------> probewire.deadletter  (key run_id)

One checkpoint at a time: parse the announcement, ask the cadence, load each weights
stream through the model factory, run the suites, publish one record per metric, wait
for delivery, then commit the offset (at least once: a crash re-scores a checkpoint,
and the records carry the same identity). A checkpoint that cannot be parsed or loaded,
and a suite that fails, produce a dead-letter record with the reason; the service goes
on with the next one.

Replicas of one deployment share the consumer group ``<stream.app_id>.evaluator`` and
split the checkpoint topic's partitions (a run's checkpoints share a key, so one
replica scores a run in order). SIGTERM stops the service between two progress ticks;
an interrupted checkpoint is neither published nor committed, so the next owner of the
partition scores it again.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probewire.instrument.plumbing import Heartbeat, default_heartbeat_path

from .cadence import Cadence
from .config import EvaluatorSetup
from .datadir import DEFAULT_SUITES, build_suites, check_suite_names, ensure_demo_datasets
from .lm import Tokenizer, resolve_callable
from .records import CheckpointEvent, EvalRecord, EvaluationError
from .runner import (
    CheckpointLoader,
    EvaluationCancelled,
    ReferenceStream,
    SuiteFailure,
    evaluate_checkpoint,
)

__all__ = ["EvaluatorOptions", "EvaluatorService", "ProcessResult", "ServiceError", "ServiceStats"]

log = logging.getLogger(__name__)

_BEAT_EVERY_S = 2.0


class ServiceError(RuntimeError):
    """The service cannot go on (no partitions, undeliverable results); one line."""


@dataclass(kw_only=True, slots=True)
class EvaluatorOptions:
    """The evaluator's run options: ``settings.evaluator``, overridden by the CLI flags.

    ``data_dir`` None means ``settings.evaluator.data_dir``, or ``./probewire-evals``
    when that is empty. ``group_id`` None means the setup's (``evaluator.group_id``, else
    ``<stream.app_id>.evaluator``).
    ``tokenizer`` is a ``module:callable`` returning the tokenizer. ``context_len`` None
    reads it from the model (``runner._context_len``).
    """

    suites: tuple[str, ...] = DEFAULT_SUITES
    data_dir: str | None = None
    group_id: str | None = None
    reference_stream: ReferenceStream = "auto"
    tokenizer: str = "probewire.evaluators.lm:ByteTokenizer"
    context_len: int | None = None
    batch_size: int = 16
    device: str = "cpu"
    heartbeat_path: Path | None = None
    show_progress: bool = False
    assign_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise EvaluationError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.reference_stream not in ("auto", "raw", "ema"):
            raise EvaluationError(
                f"reference_stream must be auto, raw or ema, got {self.reference_stream!r}"
            )


@dataclass(slots=True)
class ProcessResult:
    """What one checkpoint message produced."""

    evaluated: bool
    reason: str
    run_id: str | None = None
    records: list[EvalRecord] = field(default_factory=list)
    deadletters: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class ServiceStats:
    messages: int = 0
    evaluated: int = 0
    skipped: int = 0
    failed: int = 0
    records: int = 0


def _deadletter(
    reason: str,
    source: dict[str, Any],
    payload: bytes,
    event: CheckpointEvent | None,
    failures: Sequence[SuiteFailure] = (),
) -> dict[str, Any]:
    """One dead-letter body per checkpoint message (the store keys them by topic,
    partition and offset); suite failures are listed under ``failures``."""
    body: dict[str, Any] = {
        "source": "evaluator",
        "reason": reason,
        **source,
        "payload_b64": base64.b64encode(payload).decode(),
    }
    if event is not None:
        body.update(run_id=event.run_id, step=event.step, path=event.path)
    if failures:
        body["failures"] = [
            {"suite": f.suite, "weights_stream": f.weights_stream, "reason": f.reason}
            for f in failures
        ]
    return body


class EvaluatorService:
    """The evaluator; ``process`` is the Kafka-free core, ``run`` the consumer loop.

    Construction checks everything that can be checked before the first message: the
    model factory and tokenizer import and are callable, the data sets exist (demo sets
    are written where files are missing) and are not empty.
    """

    def __init__(
        self,
        setup: EvaluatorSetup,
        options: EvaluatorOptions | None = None,
        preflight: Callable[[], None] = lambda: None,
    ) -> None:
        """Checks the configuration (tokenizer, model factory, suites), then runs
        ``preflight`` (what the service needs outside itself, the broker), then writes
        missing demo data sets: a mistake is one line before anything is written."""
        self.setup = setup
        self.options = options = options or EvaluatorOptions()
        cfg = setup.config
        self.data_dir = Path(options.data_dir or cfg.data_dir or "probewire-evals")
        tokenizer = resolve_callable(options.tokenizer, "tokenizer")()
        if not isinstance(tokenizer, Tokenizer):
            raise EvaluationError(
                f"tokenizer {options.tokenizer!r} does not provide encode, "
                f"decode, bos_id and version"
            )
        self.loader = CheckpointLoader(
            factory=cfg.model_factory,
            tokenizer=tokenizer,
            context_len=options.context_len,
            batch_size=options.batch_size,
            device=options.device,
        )
        check_suite_names(options.suites)
        preflight()
        ensure_demo_datasets(self.data_dir)
        self.suites = build_suites(options.suites, self.data_dir)
        self.cadence = Cadence(cfg.every_fraction)
        self.group_id = options.group_id or setup.group_id
        self.heartbeat = Heartbeat(
            options.heartbeat_path
            or Path(
                os.environ.get("PROBEWIRE_HEARTBEAT_FILE") or default_heartbeat_path("evaluator")
            ),
            "evaluator",
        )
        self.stop_event = threading.Event()
        self._last_beat = 0.0

    # --- the core -------------------------------------------------------------------

    def _beat(self, status: str | None = None) -> None:
        now = time.monotonic()
        if status is not None or now - self._last_beat >= _BEAT_EVERY_S:
            self.heartbeat.beat(status)
            self._last_beat = now

    def _tick(self) -> None:
        if self.stop_event.is_set():
            raise EvaluationCancelled("stopping")
        self._beat()

    def _count(self, run_id: str, what: str, step: int | None = None) -> None:
        run = self.heartbeat.runs.setdefault(run_id, {"evaluated": 0, "skipped": 0, "failed": 0})
        run[what] += 1
        if step is not None:
            run["last_step"] = step

    def process(self, payload: bytes, source: dict[str, Any] | None = None) -> ProcessResult:
        """Handle one checkpoint announcement; never raises for a bad checkpoint.

        ``source`` (topic, partition, offset) is copied into dead-letter records.
        Raises ``EvaluationCancelled`` when the service is stopping.
        """
        source = source or {}
        try:
            event = CheckpointEvent.from_json(payload)
        except EvaluationError as exc:
            return ProcessResult(
                evaluated=False,
                reason=str(exc),
                deadletters=[_deadletter(str(exc), source, payload, None)],
            )
        decision = self.cadence.decide(
            event.run_id, tokens=event.tokens, key=event.key, planned_tokens=event.planned_tokens
        )
        if not decision.evaluate:
            log.info("skip %s step %d: %s", event.run_id, event.step, decision.reason)
            self._count(event.run_id, "skipped")
            return ProcessResult(evaluated=False, reason=decision.reason, run_id=event.run_id)
        log.info("evaluate %s step %d (%s)", event.run_id, event.step, decision.reason)
        self._beat("evaluating")
        try:
            records, failures = evaluate_checkpoint(
                event,
                self.loader,
                self.suites,
                reference_stream=self.options.reference_stream,
                show_progress=self.options.show_progress,
                tick=self._tick,
            )
        except EvaluationError as exc:
            log.warning("checkpoint %s step %d failed: %s", event.run_id, event.step, exc)
            self._count(event.run_id, "failed", event.step)
            self._beat("ready")
            return ProcessResult(
                evaluated=False,
                reason=str(exc),
                run_id=event.run_id,
                deadletters=[_deadletter(str(exc), source, payload, event)],
            )
        deadletters = []
        if failures:
            reason = "; ".join(
                f"suite {f.suite} on {f.weights_stream} weights: {f.reason}" for f in failures
            )
            deadletters.append(
                _deadletter(
                    f"{len(failures)} suite run(s) failed: {reason}",
                    source,
                    payload,
                    event,
                    failures,
                )
            )
        self._count(event.run_id, "evaluated", event.step)
        self._beat("ready")
        return ProcessResult(
            evaluated=True,
            reason=decision.reason,
            run_id=event.run_id,
            records=records,
            deadletters=deadletters,
        )

    # --- the Kafka loop -------------------------------------------------------------

    def _clients(self, once: bool) -> tuple[Any, Any]:
        from confluent_kafka import Consumer, Producer

        base = self.setup.kafka.client_config()
        consumer = Consumer(
            {
                **base,
                "group.id": self.group_id,
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                "session.timeout.ms": 6000,
                "heartbeat.interval.ms": 1000,
                # a long evaluation must not look like a dead consumer;
                # liveness comes from the heartbeat file instead
                "max.poll.interval.ms": 86_400_000,
                "enable.partition.eof": once,
            }
        )
        producer = Producer({**base, "acks": "all", "linger.ms": 5})
        return consumer, producer

    def _publish(self, producer: Any, result: ProcessResult) -> None:
        topics = self.setup.topics
        errors: list[str] = []

        def delivered(err: Any, _msg: Any) -> None:
            if err is not None:
                errors.append(str(err))

        key = (result.run_id or "").encode()
        for record in result.records:
            producer.produce(topics.evals, key=key, value=record.to_json(), on_delivery=delivered)
        for body in result.deadletters:
            producer.produce(
                topics.deadletter, key=key, value=json.dumps(body).encode(), on_delivery=delivered
            )
        remaining = producer.flush(60)
        if errors or remaining:
            raise ServiceError(
                f"publishing failed ({remaining} undelivered): "
                f"{errors[0] if errors else 'flush timed out'}"
            )

    def run(self, *, once: bool = False) -> ServiceStats:
        """Consume until SIGTERM / ``stop_event``; with ``once``, until every assigned
        partition has reported end-of-partition (what was queued has been handled).

        End of partition comes from the consumer's EOF events rather than from
        watermark offsets, which the embedded broker (Tansu) reports per record batch.
        """
        from confluent_kafka import KafkaError

        stats = ServiceStats()
        restore = self._handle_sigterm()
        consumer, producer = self._clients(once)
        assigned: set[tuple[str, int]] = set()
        at_end: set[tuple[str, int]] = set()

        def on_assign(_consumer: Any, partitions: Sequence[Any]) -> None:
            assigned.update((tp.topic, tp.partition) for tp in partitions)

        def on_revoke(_consumer: Any, partitions: Sequence[Any]) -> None:
            assigned.difference_update((tp.topic, tp.partition) for tp in partitions)

        self._beat("starting")
        try:
            consumer.subscribe(
                [self.setup.topics.checkpoints], on_assign=on_assign, on_revoke=on_revoke
            )
            deadline = time.monotonic() + self.options.assign_timeout_s
            self._beat("ready")
            while not self.stop_event.is_set():
                msg = consumer.poll(0.5)
                self._beat()
                if once and not assigned and time.monotonic() > deadline:
                    raise ServiceError(
                        f"no partition of {self.setup.topics.checkpoints} "
                        f"assigned within {self.options.assign_timeout_s:g}s"
                    )
                if msg is None:
                    continue
                where = (msg.topic(), msg.partition())
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        at_end.add(where)
                        if once and assigned <= at_end:
                            break
                    else:
                        log.warning("consumer error: %s", msg.error())
                    continue
                at_end.discard(where)
                source = {
                    "topic": msg.topic(),
                    "partition": msg.partition(),
                    "offset": msg.offset(),
                }
                try:
                    result = self.process(msg.value() or b"", source)
                except EvaluationCancelled:
                    log.info("stopping: checkpoint at offset %d left for a later run", msg.offset())
                    break
                self._publish(producer, result)
                consumer.commit(message=msg, asynchronous=False)
                stats.messages += 1
                stats.records += len(result.records)
                stats.evaluated += result.evaluated
                stats.failed += bool(result.deadletters) and not result.evaluated
                stats.skipped += not result.evaluated and not result.deadletters
        finally:
            consumer.close()
            producer.flush(10)
            self.heartbeat.beat("stopped")
            restore()
        return stats

    def _handle_sigterm(self) -> Callable[[], None]:
        """Make SIGTERM (and SIGINT) set the stop event; return a function that undoes it."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

        def stop(signum: int, _frame: object) -> None:
            log.info("signal %d: stopping after the current progress tick", signum)
            self.stop_event.set()

        for sig in previous:
            signal.signal(sig, stop)

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore
