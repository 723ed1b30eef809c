"""OTLP bytes -> RankStep, and the reasons malformed messages are dead-lettered with."""

from __future__ import annotations

import math

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from probewire.instrument.export import StepEmitter
from probewire.instrument.wire import Point, RankIdentity
from probewire.instrument.testing import MemoryTransport
from probewire.instrument.wire import DecodeError, decode_rank_step
from probewire.instrument.wire import series_key


def emitted(points, step: int = 7) -> tuple[bytes, bytes]:
    transport = MemoryTransport()
    emitter = StepEmitter(RankIdentity(run_id="run1", rank=1, world_size=2, host="n1",
                                       coords={"dp": 1}), transport)
    emitter.emit(step, points)
    emitter.close()
    (message,) = transport.messages
    return message


def test_round_trip_including_nonfinite_values():
    key, value = emitted([Point("loss.sum", math.nan), Point("loss.tokens", 12),
                          Point("grad.norm_sq", math.inf), Point("step_time_s", 0.25)])
    assert key == b"run1:7"
    step = decode_rank_step(key, value)
    assert (step.run_id, step.step, step.rank, step.world_size, step.host) == ("run1", 7, 1, 2, "n1")
    assert step.coords == {"dp": 1}
    assert math.isnan(step.values[series_key("loss.sum")])
    assert math.isinf(step.values[series_key("grad.norm_sq")])
    assert step.values[series_key("loss.tokens")] == 12.0
    assert step.values[series_key("step_time_s")] == 0.25


def test_garbage_bytes_are_a_decode_error():
    with pytest.raises(DecodeError, match="not an OTLP"):
        decode_rank_step(b"k", b"\xff\xfe not protobuf")


def test_key_that_does_not_match_content_is_rejected():
    key, value = emitted([Point("loss.tokens", 1)])
    with pytest.raises(DecodeError, match="does not match"):
        decode_rank_step(b"run1:8", value)


def test_unknown_metric_is_rejected():
    key, value = emitted([Point("loss.tokens", 1)])
    request = ExportMetricsServiceRequest.FromString(value)
    request.resource_metrics[0].scope_metrics[0].metrics[0].name = "made.up"
    with pytest.raises(DecodeError, match="unknown metric"):
        decode_rank_step(key, request.SerializeToString())


def test_missing_rank_attribute_is_rejected():
    key, value = emitted([Point("loss.tokens", 1)])
    request = ExportMetricsServiceRequest.FromString(value)
    attrs = request.resource_metrics[0].resource.attributes
    keep = [a for a in attrs if a.key != "probewire.rank"]
    del attrs[:]
    attrs.extend(keep)
    with pytest.raises(DecodeError, match="probewire.rank"):
        decode_rank_step(key, request.SerializeToString())
