"""OTLP ``ExportMetricsServiceRequest`` bytes -> ``RankStep``; anything else is a DecodeError.

The message is read with the stock ``opentelemetry-proto`` classes, the same ones an
OpenTelemetry Collector's Kafka receiver (``otlp_proto``) uses.
"""

from __future__ import annotations

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from google.protobuf.message import DecodeError as _ProtoDecodeError

from probewire.instrument.catalog import CATALOG

from .records import RankStep

__all__ = ["DecodeError", "decode_rank_step"]

_NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
_NONFINITE_ATTR = "probewire.nonfinite"
_GROUPS = ("dp", "tp", "pp", "cp", "ep")


class DecodeError(ValueError):
    """A message that cannot become a RankStep; ``reason`` goes to the dead-letter topic."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _any_value(value) -> str | int | float | bool:
    kind = value.WhichOneof("value")
    if kind is None:
        raise DecodeError("attribute with no value")
    return getattr(value, kind)


def decode_rank_step(key: bytes | None, payload: bytes) -> RankStep:
    """Decode one rank's message for one step, checking it against its key and the catalog."""
    try:
        request = ExportMetricsServiceRequest.FromString(payload)
    except _ProtoDecodeError as exc:
        raise DecodeError(f"not an OTLP ExportMetricsServiceRequest: {exc}") from None
    if len(request.resource_metrics) != 1:
        raise DecodeError(f"expected 1 resource, got {len(request.resource_metrics)}")
    resource_metrics = request.resource_metrics[0]
    resource = {a.key: _any_value(a.value) for a in resource_metrics.resource.attributes}
    try:
        run_id = str(resource["probewire.run_id"])
        rank = int(resource["probewire.rank"])
        world_size = int(resource["probewire.world_size"])
    except KeyError as exc:
        raise DecodeError(f"resource attribute {exc.args[0]} missing") from None
    if not 0 <= rank < world_size:
        raise DecodeError(f"rank {rank} outside world size {world_size}")
    coords = {g: int(resource[f"probewire.{g}"]) for g in _GROUPS if f"probewire.{g}" in resource}

    values: dict = {}
    step: int | None = None
    for scope in resource_metrics.scope_metrics:
        for metric in scope.metrics:
            spec = CATALOG.get(metric.name)
            if spec is None:
                raise DecodeError(f"unknown metric {metric.name!r}")
            if metric.WhichOneof("data") != "gauge":
                raise DecodeError(f"metric {metric.name!r} is not a gauge")
            allowed = spec.labels
            for point in metric.gauge.data_points:
                point_step, nonfinite, labels = None, None, []
                for attr in point.attributes:  # the hot loop: each field read once
                    name, value = attr.key, attr.value
                    if name == "step":
                        if value.WhichOneof("value") != "int_value":
                            raise DecodeError(f"point of {metric.name!r} has no integer step")
                        point_step = value.int_value
                    elif name in allowed:  # labels are strings but for the odd producer
                        labels.append((name, value.string_value
                                       if value.WhichOneof("value") == "string_value"
                                       else str(_any_value(value))))
                    elif name == _NONFINITE_ATTR:
                        nonfinite = value.string_value
                    else:
                        raise DecodeError(f"{metric.name!r} has label {name!r} outside its "
                                          "catalog label set")
                if point_step is None:
                    raise DecodeError(f"point of {metric.name!r} has no integer step")
                if step is None:
                    step = point_step
                elif point_step != step:
                    raise DecodeError(f"expected points of exactly one step, got {step} "
                                      f"and {point_step}")
                if nonfinite is not None:
                    if nonfinite not in _NONFINITE:
                        raise DecodeError(f"bad {_NONFINITE_ATTR} value {nonfinite!r}")
                    value = _NONFINITE[nonfinite]
                elif point.WhichOneof("value") == "as_double":
                    value = point.as_double
                else:
                    value = float(point.as_int)
                if len(labels) > 1:
                    labels.sort()
                values[(metric.name, tuple(labels))] = value
    if step is None:
        raise DecodeError("message holds no data point")
    if key is not None:
        expected = f"{run_id}:{step}".encode()
        if key != expected:
            raise DecodeError(f"key {key!r} does not match content {expected!r}")
    return RankStep(run_id=run_id, step=step, rank=rank, world_size=world_size,
                    host=str(resource.get("host.name", "")), coords=coords, values=values)
