"""Fakes and references that ship with the library (for tests, benchmarks and notebooks).

``MemoryTransport`` keeps what it is sent; ``NullTransport`` counts it. ``ProtoEncoder``
and ``SdkEncoder`` write the same message as ``wire.WireEncoder`` the slow, obvious ways —
the stock ``opentelemetry-proto`` classes, and the OpenTelemetry SDK (a MeterProvider with
DELTA Gauges and the stock OTLP encoder) — so tests and benchmarks can hold the wire
encoder against them. Production uses ``WireEncoder`` only: the SDK path costs ~2 ms per
50 points and drops NaN/±Inf, and its Python work on the emitter thread competes with
the training thread for the GIL.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence

from .catalog import CATALOG
from .wire import NONFINITE_ATTR, REPLAY_ATTR, SCOPE, STEP_ATTR, Point, scope_version

__all__ = ["MemoryTransport", "NullTransport", "ProtoEncoder", "SdkEncoder"]


class MemoryTransport:
    """Keeps every (key, value) it is sent, in order; thread-safe."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes]] = []
        self._lock = threading.Lock()
        self.closed = False

    def send(self, key: bytes, value: bytes) -> bool:
        with self._lock:
            self.messages.append((key, value))
        return True

    def flush(self, timeout_s: float) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class NullTransport:
    """Drops every message and counts them and their bytes (benchmarks)."""

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0

    def send(self, key: bytes, value: bytes) -> bool:
        self.messages += 1
        self.bytes += len(key) + len(value)
        return True

    def flush(self, timeout_s: float) -> int:
        return 0

    def close(self) -> None:
        return None


def _value(raw: object) -> tuple[float, str | None]:
    """The float and, for a non-finite one, its marker "nan"|"inf"|"-inf" (the wire rule)."""
    number = float(raw)  # type: ignore[arg-type]
    if math.isfinite(number):
        return number, None
    return number, ("nan" if math.isnan(number) else ("inf" if number > 0 else "-inf"))


class ProtoEncoder:
    """The request built object by object with the ``opentelemetry-proto`` classes."""

    def __init__(self, resource_attributes: Mapping[str, str | int | bool]) -> None:
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
        from opentelemetry.proto.resource.v1.resource_pb2 import Resource

        def any_value(v: str | int | bool) -> AnyValue:
            if isinstance(v, bool):
                return AnyValue(bool_value=v)
            if isinstance(v, int):
                return AnyValue(int_value=v)
            return AnyValue(string_value=str(v))

        self._resource = Resource(
            attributes=[KeyValue(key=k, value=any_value(v)) for k, v in resource_attributes.items()]
        )
        self._replay_resource = Resource(
            attributes=[
                *self._resource.attributes,
                KeyValue(key=REPLAY_ATTR, value=AnyValue(bool_value=True)),
            ]
        )

    def encode(self, step: int, points: Sequence[Point], *, replay: bool = False) -> bytes:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )

        request = ExportMetricsServiceRequest()
        resource_metrics = request.resource_metrics.add()
        resource_metrics.resource.CopyFrom(self._replay_resource if replay else self._resource)
        scope = resource_metrics.scope_metrics.add()
        scope.scope.name = SCOPE
        scope.scope.version = scope_version()
        now = time.time_ns()
        metrics: dict[str, object] = {}
        for name, raw, labels in points:
            metric = metrics.get(name)
            if metric is None:
                unit = CATALOG[name].unit if name in CATALOG else "1"
                metric = metrics[name] = scope.metrics.add(name=name, unit=unit)
            value, nonfinite = _value(raw)
            point = metric.gauge.data_points.add(time_unix_nano=now, as_double=value)
            attrs = point.attributes
            attrs.add(key=STEP_ATTR).value.int_value = step
            for key, label in labels:
                attrs.add(key=key).value.string_value = label
            if nonfinite is not None:
                attrs.add(key=NONFINITE_ATTR).value.string_value = nonfinite
        return request.SerializeToString()


class SdkEncoder:
    """The same message through the OpenTelemetry SDK (MeterProvider, DELTA Gauges)."""

    def __init__(self, resource_attributes: Mapping[str, str | int | bool]) -> None:
        from opentelemetry.sdk.metrics import MeterProvider, _Gauge
        from opentelemetry.sdk.metrics.export import (
            AggregationTemporality,
            InMemoryMetricReader,
        )
        from opentelemetry.sdk.resources import Resource

        self._reader = InMemoryMetricReader(
            preferred_temporality={_Gauge: AggregationTemporality.DELTA}
        )
        self._provider = MeterProvider(
            resource=Resource.create(dict(resource_attributes)), metric_readers=[self._reader]
        )
        self._replay: SdkEncoder | None = None
        self._attrs = dict(resource_attributes)
        self._meter = self._provider.get_meter(SCOPE)
        self._gauges: dict[str, object] = {}

    def _gauge(self, name: str):
        gauge = self._gauges.get(name)
        if gauge is None:
            unit = CATALOG[name].unit if name in CATALOG else "1"
            gauge = self._gauges[name] = self._meter.create_gauge(name, unit=unit)
        return gauge

    def encode(self, step: int, points: Sequence[Point], *, replay: bool = False) -> bytes:
        from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

        if replay:
            if self._replay is None:
                self._replay = SdkEncoder({**self._attrs, REPLAY_ATTR: True})
            return self._replay.encode(step, points)
        for point in points:
            value, nonfinite = _value(point.value)
            if nonfinite is not None:
                value = 0.0  # the SDK's Gauge drops NaN and ±Inf: the marker carries them
            attrs: dict[str, str | int] = {STEP_ATTR: step, **dict(point.labels)}
            if nonfinite is not None:
                attrs[NONFINITE_ATTR] = nonfinite
            self._gauge(point.name).set(value, attributes=attrs)
        return encode_metrics(self._reader.get_metrics_data()).SerializeToString()

    def shutdown(self) -> None:
        self._provider.shutdown()
        if self._replay is not None:
            self._replay.shutdown()
