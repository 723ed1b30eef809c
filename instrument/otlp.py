"""OTLP encoding of one rank's step: ``(step, points) -> ExportMetricsServiceRequest`` bytes.

Every point becomes one Gauge data point with the integer attribute ``step`` and its
labels; a non-finite value is sent as 0.0 with the attribute ``probewire.nonfinite``
naming it ("nan", "inf", "-inf") because the OpenTelemetry SDK's Gauge drops NaN/±Inf.
The message decodes with the stock ``opentelemetry-proto`` classes (what an OpenTelemetry
Collector's Kafka receiver with ``otlp_proto`` uses) and with
``probewire.stream.decode.decode_rank_step``.

Three encoders produce the same message (tests compare them):

``WireEncoder`` (default) writes the protobuf wire format itself from cached fragments
(the resource, each metric's name and unit, each label set, written once); per point it
packs the step, time and value. About 1 µs per point, no state per step; its caches are
bounded by the catalog and the bounded label sets.
``ProtoEncoder`` fills the ``opentelemetry-proto`` message object by object (~2–3 µs per
point): the readable reference.
``SdkEncoder`` goes through an OpenTelemetry ``MeterProvider`` (synchronous Gauges,
DELTA temporality so the SDK forgets every attribute set at each collection) and the
stock OTLP encoder. It is about 5× slower; measured on the tiny demo model, its Python
time on the emitter thread competes for the GIL and shows up as ~8 % on the training
thread's step time, which is why it is not the default.
"""

from __future__ import annotations

import math
import struct
import time
from typing import Mapping, NamedTuple, Protocol, Sequence

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ProtoResource

from .catalog import CATALOG

__all__ = ["ENCODERS", "NONFINITE_ATTR", "REPLAY_ATTR", "STEP_ATTR", "Encoder", "Point",
           "ProtoEncoder", "SdkEncoder", "WireEncoder", "as_point_value"]

NONFINITE_ATTR = "probewire.nonfinite"
REPLAY_ATTR = "probewire.replay"   # resource attribute of messages re-sent from the ring buffer
STEP_ATTR = "step"
SCOPE = "probewire.instrument"


class Point(NamedTuple):
    """One measurement: a catalog metric name, its value and its (bounded) labels."""

    name: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


class Encoder(Protocol):
    def encode(self, step: int, points: Sequence[Point], *, replay: bool = False) -> bytes: ...

    def shutdown(self) -> None: ...


def as_point_value(value: object) -> tuple[float, str | None]:
    """A finite float, or (0.0, "nan"|"inf"|"-inf") for a non-finite one."""
    number = float(value)  # tensors, numpy scalars and bools become plain floats
    if math.isfinite(number):
        return number, None
    return 0.0, ("nan" if math.isnan(number) else ("inf" if number > 0 else "-inf"))


def _any(value: str | int | float | bool) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    return AnyValue(string_value=str(value))


class ProtoEncoder:
    """Builds the request with the ``opentelemetry-proto`` classes; nothing kept per step."""

    def __init__(self, resource_attributes: Mapping[str, str | int | bool]) -> None:
        attrs = dict(resource_attributes)
        self._resource = ProtoResource(attributes=[KeyValue(key=k, value=_any(v))
                                                   for k, v in attrs.items()])
        self._replay_resource = ProtoResource(attributes=[
            *self._resource.attributes, KeyValue(key=REPLAY_ATTR, value=AnyValue(bool_value=True))])
        self._units = {name: s.unit for name, s in CATALOG.items()}

    def encode(self, step: int, points: Sequence[Point], *, replay: bool = False) -> bytes:
        request = ExportMetricsServiceRequest()
        resource_metrics = request.resource_metrics.add()
        resource_metrics.resource.CopyFrom(self._replay_resource if replay else self._resource)
        scope = resource_metrics.scope_metrics.add()
        scope.scope.name = SCOPE
        now = time.time_ns()
        metrics: dict[str, object] = {}
        for name, raw, labels in points:
            metric = metrics.get(name)
            if metric is None:
                metric = scope.metrics.add(name=name, unit=self._units.get(name, "1"))
                metrics[name] = metric
            value, nonfinite = as_point_value(raw)
            point = metric.gauge.data_points.add(time_unix_nano=now, as_double=value)
            attrs = point.attributes
            attrs.add(key=STEP_ATTR).value.int_value = step
            for key, label in labels:
                attrs.add(key=key).value.string_value = label
            if nonfinite is not None:
                attrs.add(key=NONFINITE_ATTR).value.string_value = nonfinite
        return request.SerializeToString()

    def shutdown(self) -> None:
        return None


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
            preferred_temporality={_Gauge: AggregationTemporality.DELTA})
        self._provider = MeterProvider(resource=Resource.create(dict(resource_attributes)),
                                       metric_readers=[self._reader])
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
            value, nonfinite = as_point_value(point.value)
            attrs: dict[str, str | int] = {STEP_ATTR: step, **dict(point.labels)}
            if nonfinite is not None:
                attrs[NONFINITE_ATTR] = nonfinite
            self._gauge(point.name).set(value, attributes=attrs)
        return encode_metrics(self._reader.get_metrics_data()).SerializeToString()

    def shutdown(self) -> None:
        self._provider.shutdown()
        if self._replay is not None:
            self._replay.shutdown()


# ---------------------------------------------------------------------- wire format
_DOUBLE = struct.Struct("<d").pack
_FIXED64 = struct.Struct("<Q").pack


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _key_value(key: str, value: AnyValue) -> bytes:
    return _field(1, key.encode()) + _field(2, value.SerializeToString())


_NUMBER_POINT_ATTR = 7   # NumberDataPoint.attributes
_TIME_TAG = bytes((3 << 3 | 1,))    # NumberDataPoint.time_unix_nano, fixed64
_DOUBLE_TAG = bytes((4 << 3 | 1,))  # NumberDataPoint.as_double, double


class WireEncoder:
    """The OTLP message written field by field from cached fragments (see the module doc)."""

    def __init__(self, resource_attributes: Mapping[str, str | int | bool]) -> None:
        attrs = dict(resource_attributes)
        resource = b"".join(_field(1, _key_value(k, _any(v))) for k, v in attrs.items())
        replay = resource + _field(1, _key_value(REPLAY_ATTR, AnyValue(bool_value=True)))
        self._resource = _field(1, resource)         # ResourceMetrics.resource
        self._replay_resource = _field(1, replay)
        self._scope = _field(1, _field(1, SCOPE.encode()))  # ScopeMetrics.scope.name
        self._units = {name: s.unit for name, s in CATALOG.items()}
        self._metric_head: dict[str, bytes] = {}
        self._labels: dict[tuple[tuple[str, str], ...], bytes] = {}
        self._nonfinite = {tag: _field(_NUMBER_POINT_ATTR, _key_value(
            NONFINITE_ATTR, AnyValue(string_value=tag))) for tag in ("nan", "inf", "-inf")}

    def _head(self, name: str) -> bytes:
        head = self._metric_head.get(name)
        if head is None:  # Metric.name (1) and Metric.unit (3)
            head = self._metric_head[name] = (_field(1, name.encode())
                                              + _field(3, self._units.get(name, "1").encode()))
        return head

    def _label_bytes(self, labels: tuple[tuple[str, str], ...]) -> bytes:
        cached = self._labels.get(labels)
        if cached is None:
            cached = self._labels[labels] = b"".join(
                _field(_NUMBER_POINT_ATTR, _key_value(k, AnyValue(string_value=v)))
                for k, v in labels)
        return cached

    def encode(self, step: int, points: Sequence[Point], *, replay: bool = False) -> bytes:
        step_attr = _field(_NUMBER_POINT_ATTR, _key_value(STEP_ATTR, AnyValue(int_value=step)))
        stamp = _TIME_TAG + _FIXED64(time.time_ns()) + _DOUBLE_TAG
        by_metric: dict[str, list[bytes]] = {}
        for name, raw, labels in points:
            number = float(raw)
            if math.isfinite(number):
                body = step_attr + self._label_bytes(labels) + stamp + _DOUBLE(number)
            else:
                tag = "nan" if math.isnan(number) else ("inf" if number > 0 else "-inf")
                body = (step_attr + self._label_bytes(labels) + self._nonfinite[tag] + stamp
                        + _DOUBLE(0.0))
            points_of = by_metric.get(name)
            if points_of is None:
                points_of = by_metric[name] = []
            points_of.append(b"\x0a" + _varint(len(body)) + body)  # Gauge.data_points (1)
        metrics = b"".join(
            _field(2, self._head(name) + _field(5, b"".join(data)))  # ScopeMetrics.metrics,
            for name, data in by_metric.items())                     # Metric.gauge (5)
        resource_metrics = ((self._replay_resource if replay else self._resource)
                            + _field(2, self._scope + metrics))      # scope_metrics (2)
        return _field(1, resource_metrics)  # ExportMetricsServiceRequest.resource_metrics

    def shutdown(self) -> None:
        return None


ENCODERS = {"wire": WireEncoder, "proto": ProtoEncoder, "sdk": SdkEncoder}
