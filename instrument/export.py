"""Asynchronous OTLP export: one ``ExportMetricsServiceRequest`` per rank per step into Kafka.

The training thread only enqueues ``(step, points)`` (a bounded queue; what it cannot hold
is counted, never blocks). One background thread owns the OpenTelemetry MeterProvider:
it sets one synchronous Gauge point per (metric, step, labels), collects with DELTA
temporality so the SDK keeps no per-step state, encodes with the stock OTLP encoder and
hands the bytes to a transport (Kafka, key ``<run_id>:<step>``).

Two SDK behaviours are worked around here, both measured on SDK 1.45:
``Gauge.set`` silently drops NaN/±Inf, so a non-finite value is sent as 0.0 with the
attribute ``probewire.nonfinite`` naming it ("nan", "inf", "-inf"); and the encoder
rejects bools and tensors, so every value is converted to a Python float here.
"""

from __future__ import annotations

import logging
import math
import queue
import socket
import threading
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Protocol

from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.sdk.metrics import MeterProvider, _Gauge
from opentelemetry.sdk.metrics.export import AggregationTemporality, InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

from .catalog import CATALOG

__all__ = [
    "NONFINITE_ATTR",
    "KafkaTransport",
    "NullEmitter",
    "Point",
    "RankIdentity",
    "StepEmitter",
    "Transport",
]

log = logging.getLogger(__name__)

NONFINITE_ATTR = "probewire.nonfinite"
STEP_ATTR = "step"
EXPORT_DROPPED = "export.dropped_total"


class Point(NamedTuple):
    """One measurement: a catalog metric name, its value and its (bounded) labels."""

    name: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RankIdentity:
    """Who is speaking: the OTLP resource attributes of every message from this rank."""

    run_id: str
    rank: int
    world_size: int
    host: str = field(default_factory=socket.gethostname)
    local_rank: int = 0
    coords: Mapping[str, int] = field(default_factory=dict)  # group name (dp/tp/...) -> index

    def __post_init__(self) -> None:
        if not self.run_id or ":" in self.run_id:
            raise ValueError(f"run_id must be non-empty and contain no ':', got {self.run_id!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")

    def resource_attributes(self) -> dict[str, str | int]:
        attrs: dict[str, str | int] = {
            "service.name": "probewire-rank",
            "host.name": self.host,
            "probewire.run_id": self.run_id,
            "probewire.rank": self.rank,
            "probewire.world_size": self.world_size,
            "probewire.local_rank": self.local_rank,
        }
        coords = dict(self.coords) or {"dp": self.rank}
        for group, index in coords.items():
            attrs[f"probewire.{group}"] = int(index)
        return attrs


class Transport(Protocol):
    """Where encoded messages go. ``send`` never raises; it returns False on failure."""

    def send(self, key: bytes, value: bytes) -> bool: ...

    def flush(self, timeout_s: float) -> int: ...

    def close(self) -> None: ...


class KafkaTransport:
    """confluent-kafka producer (it reports delivery failures that aiokafka hides)."""

    def __init__(self, client_config: Mapping[str, str], topic: str) -> None:
        from confluent_kafka import KafkaException, Producer

        self._errors = (BufferError, KafkaException)
        self._topic = topic
        self._producer = Producer({**client_config, "linger.ms": "5", "acks": "all",
                                   "enable.idempotence": "false"})
        self.failed = 0

    def _on_delivery(self, err: object, _msg: object) -> None:
        if err is not None:
            self.failed += 1
            log.warning("probewire: delivery failed: %s", err)

    def send(self, key: bytes, value: bytes) -> bool:
        try:
            self._producer.produce(self._topic, key=key, value=value, on_delivery=self._on_delivery)
            self._producer.poll(0)
            return True
        except self._errors as exc:
            log.warning("probewire: produce failed: %s", exc)
            self.failed += 1
            return False

    def flush(self, timeout_s: float) -> int:
        return self._producer.flush(timeout_s)

    def close(self) -> None:
        self.flush(10.0)


def _as_point_value(value: object) -> tuple[float, str | None]:
    """A finite float, or (0.0, "nan"|"inf"|"-inf") for a non-finite one."""
    number = float(value)  # tensors, numpy scalars and bools become plain floats
    if math.isfinite(number):
        return number, None
    return 0.0, ("nan" if math.isnan(number) else ("inf" if number > 0 else "-inf"))


class StepEmitter:
    """Owns the queue, the thread and the MeterProvider of one rank."""

    def __init__(self, identity: RankIdentity, transport: Transport, *, queue_size: int = 256) -> None:
        self.identity = identity
        self._transport = transport
        self._queue: queue.Queue[tuple[int, list[Point]] | None] = queue.Queue(maxsize=queue_size)
        self.dropped = 0      # steps the training thread could not enqueue
        self.sent = 0
        self.errors = 0
        self._reader = InMemoryMetricReader(
            preferred_temporality={_Gauge: AggregationTemporality.DELTA})
        self._provider = MeterProvider(
            resource=Resource.create(identity.resource_attributes()), metric_readers=[self._reader])
        self._meter = self._provider.get_meter("probewire.instrument")
        self._gauges: dict[str, object] = {}
        self._thread = threading.Thread(target=self._run, name="probewire-emitter", daemon=True)
        self._thread.start()

    def emit(self, step: int, points: Iterable[Point]) -> None:
        """Training thread: enqueue and return. A full queue drops the step and counts it."""
        try:
            self._queue.put_nowait((int(step), list(points)))
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain the queue, flush the transport, stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._transport.flush(timeout_s)
        self._transport.close()
        self._provider.shutdown()

    def _gauge(self, name: str):
        gauge = self._gauges.get(name)
        if gauge is None:
            unit = CATALOG[name].unit if name in CATALOG else "1"
            gauge = self._meter.create_gauge(name, unit=unit)
            self._gauges[name] = gauge
        return gauge

    def _encode(self, step: int, points: list[Point]) -> bytes:
        for point in [*points, Point(EXPORT_DROPPED, float(self.dropped))]:
            value, nonfinite = _as_point_value(point.value)
            attrs: dict[str, str | int] = {STEP_ATTR: step, **dict(point.labels)}
            if nonfinite is not None:
                attrs[NONFINITE_ATTR] = nonfinite
            self._gauge(point.name).set(value, attributes=attrs)
        data = self._reader.get_metrics_data()
        return encode_metrics(data).SerializeToString()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, points = item
            try:
                payload = self._encode(step, points)
            except Exception:  # contained: a broken batch must never reach the training loop
                self.errors += 1
                log.exception("probewire: could not encode step %d", step)
                continue
            key = f"{self.identity.run_id}:{step}".encode()
            if self._transport.send(key, payload):
                self.sent += 1
            else:
                self.errors += 1


class NullEmitter:
    """The disabled emitter: same methods, no work, so call sites never branch."""

    dropped = 0
    sent = 0
    errors = 0

    def emit(self, step: int, points: Iterable[Point]) -> None:
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        return None
