"""Control channel and checkpoint events.

``ControlListener`` runs one background thread per rank that consumes the topic
``probewire.control`` (published by the stream when a detector fires, or by a person)::

    {"run_id": "...", "action": "densify", "steps": M}   # P0+P1 probes every step, M steps
    {"run_id": "...", "action": "dump"}                   # re-send the ring buffer

A message without ``run_id`` addresses every run; one for another run is ignored. Each
rank uses a fresh consumer group id and assigns itself every partition at its current
end (no group rebalance, no replay of old commands): ``ready`` is set once it listens.
Nothing here ever raises into the training loop: broker errors, bad JSON and unknown
actions are logged and counted.

``checkpoint_event`` builds the JSON that rank 0 publishes to ``probewire.checkpoints``
(key = run_id) when the loop saves; the evaluator reads it
(``probewire.evaluators.records.CheckpointEvent``).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["WEIGHT_STREAMS", "ControlListener", "checkpoint_event"]

log = logging.getLogger(__name__)
kafka_log = logging.getLogger("probewire.instrument.kafka")  # one line a minute (kafkalog)

_STOP_CHECK_S = 0.25  # the longest a metadata request waits before the listener checks close

WEIGHT_STREAMS = ("raw", "ema")


def checkpoint_event(
    *,
    run_id: str,
    path: str,
    step: int,
    tokens: int,
    flops: float,
    weights_stream: str = "raw",
    key: bool = False,
) -> bytes:
    """The ``probewire.checkpoints`` message; a ValueError names a bad field."""
    if weights_stream not in WEIGHT_STREAMS:
        raise ValueError(f"weights_stream must be one of {WEIGHT_STREAMS}, got {weights_stream!r}")
    if not isinstance(step, int) or step < 0 or not isinstance(tokens, int) or tokens < 0:
        raise ValueError(f"step and tokens must be integers >= 0, got {step!r}, {tokens!r}")
    if not math.isfinite(float(flops)) or flops < 0:
        raise ValueError(f"flops must be a finite number >= 0, got {flops!r}")
    if not path:
        raise ValueError("path must not be empty")
    return json.dumps(
        {
            "run_id": run_id,
            "step": step,
            "tokens": tokens,
            "flops": float(flops),
            "path": str(path),
            "weights_stream": weights_stream,
            "key": bool(key),
        }
    ).encode()


class ControlListener:
    """Background consumer of the control topic for one rank (see the module docstring)."""

    def __init__(
        self,
        client_config: Mapping[str, str],
        *,
        run_id: str,
        rank: int,
        topic: str = "probewire.control",
        poll_s: float = 0.2,
        retry_s: float = 5.0,
        metadata_timeout_s: float = 10.0,
    ) -> None:
        self._client_config = dict(client_config)
        self.run_id, self.rank, self.topic = run_id, rank, topic
        self._poll_s, self._retry_s = poll_s, retry_s
        self._metadata_timeout_s = metadata_timeout_s
        self.ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_densify: Callable[[int], None] = lambda steps: None
        self._on_dump: Callable[[], None] = lambda: None
        self.handled = 0
        self.ignored = 0
        self.errors = 0

    def start(self, on_densify: Callable[[int], None], on_dump: Callable[[], None]) -> None:
        self._on_densify, self._on_dump = on_densify, on_dump
        self._thread = threading.Thread(target=self._run, name="probewire-control", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def handle(self, payload: bytes | None) -> str:
        """Apply one message; returns what happened ("densify", "dump", "ignored", "error")."""
        try:
            body = json.loads(payload or b"")
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
            if body.get("run_id") not in (None, self.run_id):
                self.ignored += 1
                return "ignored"
            action = body.get("action")
            if action == "densify":
                steps = body.get("steps")
                if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
                    raise ValueError(f"densify needs an integer 'steps' >= 1, got {steps!r}")
                self._on_densify(steps)
            elif action == "dump":
                self._on_dump()
            else:
                raise ValueError(f"unknown action {action!r}")
        except Exception as exc:  # contained: a bad command must not stop the listener
            self.errors += 1
            log.warning("probewire: control message rejected: %s", exc)
            return "error"
        self.handled += 1
        return action

    def _consumer(self):
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(
            {
                **self._client_config,
                "group.id": f"probewire-control-{self.run_id}-r{self.rank}-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": "false",
                "auto.offset.reset": "latest",
                "session.timeout.ms": "6000",
                "logger": kafka_log,  # librdkafka's lines: logging, one a minute
            }
        )
        try:
            timeout = self._metadata_timeout_s
            topic = self._metadata(consumer).topics[self.topic]
            if topic.error is not None:
                raise RuntimeError(f"topic {self.topic}: {topic.error}")
            assignment = []
            for partition in sorted(topic.partitions):
                _, high = consumer.get_watermark_offsets(
                    TopicPartition(self.topic, partition), timeout=timeout, cached=False
                )
                assignment.append(TopicPartition(self.topic, partition, high))
            consumer.assign(assignment)
        except Exception:
            consumer.close()
            raise
        return consumer

    def _metadata(self, consumer: Any) -> Any:
        """The topic's metadata within ``metadata_timeout_s``, asked in short waits so that
        ``close`` stops the listener at once even while no broker answers."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + self._metadata_timeout_s
        while True:
            wait = min(_STOP_CHECK_S, deadline - time.monotonic())
            try:
                return consumer.list_topics(self.topic, timeout=max(wait, 0.01))
            except KafkaException:
                if self._stop.is_set() or time.monotonic() >= deadline:
                    raise

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                consumer = self._consumer()
            except Exception as exc:
                self.errors += 1
                kafka_log.warning("probewire: control listener cannot start (%s); retrying", exc)
                self._stop.wait(self._retry_s)
                continue
            self.ready.set()
            try:
                while not self._stop.is_set():
                    message = consumer.poll(self._poll_s)
                    if message is None:
                        continue
                    if message.error() is not None:
                        self.errors += 1
                        log.warning("probewire: control consumer: %s", message.error())
                        continue
                    self.handle(message.value())
            except Exception as exc:
                self.errors += 1
                log.warning("probewire: control listener failed (%s); restarting", exc)
                self.ready.clear()
                self._stop.wait(self._retry_s)
            finally:
                try:
                    consumer.close()
                except Exception:
                    pass
