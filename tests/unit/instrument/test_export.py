"""The emitter and the OTLP message: stock proto decoding, non-finite values, bounded
memory over 100k emits, counted drops, the ring buffer's held steps sent once."""

from __future__ import annotations

import gc
import math
import sys
import threading
import tracemalloc

import pytest
import torch
import torch.nn.functional as F
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, Point, ProbeConfig, RankIdentity, attach
from probewire.instrument.catalog import Tensor
from probewire.instrument.export import StepEmitter
from probewire.instrument.testing import ProtoEncoder, SdkEncoder
from probewire.instrument.wire import WireEncoder, decode_rank_step
from probewire.stream.reduce import reduce_step

IDENTITY = RankIdentity(run_id="run1", rank=1, world_size=4, host="h1", coords={"dp": 1, "tp": 0})
POINTS = [
    Point("loss.sum", 12.5),
    Point("loss.tokens", 5),
    Point("loss.sum", 2.5, (("source", "web"),)),
    Point("grad.norm_sq", float("inf")),
    Point("tensor.abs_max", 3.0, (("tensor", "blocks.0.attn"), ("kind", "bwd"))),
    Point("step.duration", 0.25),
]


class Counting:
    """A transport that keeps only counts (so 100k messages cost no memory)."""

    def __init__(self) -> None:
        self.messages = 0
        self.last: tuple[bytes, bytes] | None = None

    def send(self, key: bytes, value: bytes) -> bool:
        self.messages += 1
        self.last = (key, value)
        return True

    def flush(self, timeout_s: float) -> int:
        return 0

    def close(self) -> None:
        return None


def attrs(kvs) -> dict:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in kvs}


@pytest.mark.parametrize("encoder", [WireEncoder, ProtoEncoder])
def test_a_message_decodes_with_the_stock_opentelemetry_proto_classes(encoder):
    payload = encoder(IDENTITY.resource_attributes()).encode(42, POINTS)
    request = ExportMetricsServiceRequest.FromString(payload)
    [rm] = request.resource_metrics
    resource = attrs(rm.resource.attributes)
    assert resource["probewire.run_id"] == "run1" and resource["probewire.rank"] == 1
    assert resource["probewire.dp"] == 1 and resource["probewire.tp"] == 0
    metrics = {m.name: m for sm in rm.scope_metrics for m in sm.metrics}
    assert metrics["step.duration"].unit == "s" and metrics["loss.sum"].unit == "{nat}"
    loss_points = {
        tuple(sorted(attrs(p.attributes).items())): p.as_double
        for p in metrics["loss.sum"].gauge.data_points
    }
    assert loss_points == {(("step", 42),): 12.5, (("source", "web"), ("step", 42)): 2.5}
    [inf] = metrics["grad.norm_sq"].gauge.data_points  # a generic consumer sees +inf
    assert inf.as_double == math.inf and attrs(inf.attributes)["probewire.nonfinite"] == "inf"


def without_time(payload: bytes) -> ExportMetricsServiceRequest:
    request = ExportMetricsServiceRequest.FromString(payload)
    for sm in request.resource_metrics[0].scope_metrics:
        for metric in sm.metrics:
            for point in metric.gauge.data_points:
                point.time_unix_nano = 0
    return request


@pytest.mark.parametrize("replay", [False, True])
def test_the_wire_encoder_writes_exactly_the_reference_message(replay):
    attributes = IDENTITY.resource_attributes()
    wire = WireEncoder(attributes).encode(7, POINTS, replay=replay)
    reference = ProtoEncoder(attributes).encode(7, POINTS, replay=replay)
    assert without_time(wire) == without_time(reference)


@pytest.mark.parametrize("encoder", [WireEncoder, ProtoEncoder, SdkEncoder])
def test_every_encoder_gives_the_same_rank_step(encoder):
    payload = encoder(IDENTITY.resource_attributes()).encode(42, POINTS)
    record = decode_rank_step(b"run1:42", payload)
    assert (record.step, record.rank, record.coords) == (42, 1, {"dp": 1, "tp": 0})
    assert record.values[("loss.sum", (("source", "web"),))] == 2.5
    assert record.values[("grad.norm_sq", ())] == math.inf
    assert record.values[("tensor.abs_max", (("kind", "bwd"), ("tensor", "blocks.0.attn")))] == 3.0
    assert len(record.values) == len(POINTS)


def test_nan_loss_and_inf_gradient_arrive_as_non_finite_measurements_not_gaps():
    torch.manual_seed(0)
    transports = [MemoryTransport(), MemoryTransport()]
    for rank, transport in enumerate(transports):
        model = TinyLM(TinyConfig(seq_len=4, d_model=8, n_layer=1, n_head=2))
        monitor = attach(
            model,
            None,
            transport=transport,
            identity=RankIdentity(run_id="nf", rank=rank, world_size=2),
            config=ProbeConfig(telemetry=False, comm=False, dp_replicated=False),
        )  # each rank its own gradient
        tokens = torch.randint(0, 256, (2, 4))
        with monitor.step(7) as s:
            s.micro_batch(tokens=tokens)
            logits = model(tokens)
            losses = F.cross_entropy(
                logits.reshape(-1, 257), tokens.reshape(-1), reduction="none"
            ).view(2, 4)
            s.loss(losses * float("nan") if rank == 0 else losses)
            losses.sum().backward()
            if rank == 1:
                model.head.weight.grad[0, 0] = float("inf")
            s.gradients()
        monitor.close()
    records = [decode_rank_step(k, v) for t in transports for k, v in t.messages]
    assert math.isnan(records[0].values[("loss.sum", ())])
    assert records[0].values[("loss.tokens", ())] == 8
    assert records[1].values[("grad.norm_sq", ())] == math.inf
    step = reduce_step("nf", 7, 2, records, "all_ranks")
    assert math.isnan(step.reduced[("loss.sum", ())])  # visible after reduction, not a gap
    assert step.per_rank[1][("grad.norm_sq", ())] == math.inf


SMALL = [Point("loss.sum", 1.0), Point("tensor.n", 4.0, (("tensor", "x"), ("kind", "fwd")))]


def growth(
    emitter: StepEmitter, transport: Counting, warm: int, traced: int, total: int
) -> tuple[int, int]:
    """(allocated-block growth from ``warm`` to ``total`` emits, tracemalloc byte growth
    over the ``traced`` emits right after ``warm``). tracemalloc slows every allocation
    ~7x, so it watches a sub-window; the block count watches the whole range for free."""

    def emit_range(a: int, b: int) -> None:
        for step in range(a, b):
            emitter.emit(step, SMALL)
            if step % 1000 == 999:
                assert emitter.flush(30.0)
        assert emitter.flush(30.0)

    emit_range(0, warm)
    gc.collect()
    blocks = sys.getallocatedblocks()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        emit_range(warm, warm + traced)
        gc.collect()  # the SDK leaves reference cycles for the collector: garbage, not growth
        traced_growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    emit_range(warm + traced, total)
    gc.collect()
    assert transport.messages == total and emitter.dropped == 0
    return sys.getallocatedblocks() - blocks, traced_growth


def test_memory_stays_flat_over_100k_emits():
    transport = Counting()
    emitter = StepEmitter(IDENTITY, transport, queue_size=1024, ring_steps=16)
    blocks, traced = growth(emitter, transport, 20_000, 10_000, 100_000)
    emitter.close()
    assert blocks < 2_000, f"{blocks} more allocated blocks after 80k more emits"
    assert traced < 64 * 1024, f"grew {traced} bytes over 10k traced emits"
    assert decode_rank_step(*transport.last).step == 99_999


class SdkEmitting:
    """The SDK reference encoder in the emitter's place (encode, send; nothing queued)."""

    dropped = 0

    def __init__(self, transport: Counting) -> None:
        self._encoder, self._transport = SdkEncoder(IDENTITY.resource_attributes()), transport

    def emit(self, step, points) -> None:
        self._transport.send(b"k", self._encoder.encode(step, points))

    def flush(self, timeout_s: float) -> bool:
        return True


def test_the_sdk_encoder_keeps_no_per_step_state():
    transport = Counting()
    emitter = SdkEmitting(transport)
    blocks, traced = growth(emitter, transport, 2_000, 2_000, 12_000)
    assert blocks < 2_000, f"{blocks} more allocated blocks after 10k more emits"
    assert traced < 64 * 1024, f"grew {traced} bytes over 2k traced emits"


def test_a_full_queue_drops_steps_counts_them_and_exports_the_count():
    gate, sending = threading.Event(), threading.Event()

    class Blocking(MemoryTransport):
        def send(self, key: bytes, value: bytes) -> bool:
            sending.set()
            gate.wait(10)
            return super().send(key, value)

    transport = Blocking()
    emitter = StepEmitter(IDENTITY, transport, queue_size=2)
    emitter.emit(0, POINTS)
    assert sending.wait(5)  # the emitter thread now blocks inside send
    for step in range(1, 10):
        emitter.emit(step, POINTS)
    dropped = emitter.dropped
    assert dropped == 7  # 2 fit in the queue
    gate.set()
    emitter.emit(10, POINTS)  # may or may not fit; its message carries the running count
    emitter.close()
    last = decode_rank_step(*transport.messages[-1])
    assert last.values[("export.dropped_total", ())] == emitter.dropped >= dropped
    assert len(transport.messages) + emitter.dropped == 11


def test_dump_sends_the_held_steps_once_marked_as_replay():
    transport = MemoryTransport()
    emitter = StepEmitter(IDENTITY, transport, ring_steps=3)
    for step in range(5):
        emitter.emit(step, POINTS, held=step != 1)  # step 1 sent whole: never in the ring
    assert emitter.flush(5.0)
    emitter.dump()
    emitter.dump()  # a second dump: nothing left to send
    emitter.close()
    steps = [decode_rank_step(k, v) for k, v in transport.messages]
    assert [r.step for r in steps] == [0, 1, 2, 3, 4, 2, 3, 4]
    assert [set(n for n, _ in r.values) for r in steps[5:]] == [{Tensor.ABS_MAX}] * 3
    assert Tensor.ABS_MAX not in {n for n, _ in steps[0].values}
    resources = [
        ExportMetricsServiceRequest.FromString(v).resource_metrics[0].resource
        for _, v in transport.messages
    ]
    replay = [attrs(r.attributes).get("probewire.replay", False) for r in resources]
    assert replay == [False] * 5 + [True] * 3


def test_with_a_detail_transport_scan_tier_points_leave_apart_and_the_step_tier_first():
    """Two paths: a step's scan-tier points (the catalog's Tier.SCAN) are their own message
    on the detail transport, after the step tier's (with the drop counter); a step with no
    scan points sends nothing there; ring dumps go there too. Every point leaves once."""
    main, detail = MemoryTransport(), MemoryTransport()
    emitter = StepEmitter(IDENTITY, main, detail=detail, ring_steps=3)
    emitter.emit(0, POINTS)
    emitter.emit(1, [p for p in POINTS if p[0] != Tensor.ABS_MAX])
    emitter.emit(2, POINTS, held=True)
    assert emitter.flush(5.0)
    emitter.dump()
    emitter.close()
    steps = [decode_rank_step(k, v) for k, v in main.messages]
    details = [decode_rank_step(k, v) for k, v in detail.messages]
    assert [r.step for r in steps] == [0, 1, 2]
    assert [(r.step, r.replay) for r in details] == [(0, False), (2, True)]
    scan_key = (Tensor.ABS_MAX, (("kind", "bwd"), ("tensor", "blocks.0.attn")))
    assert all(set(r.values) == {scan_key} for r in details)
    sent = {k for k in steps[0].values} | set(details[0].values)
    assert sent == {(n, tuple(sorted(labels))) for n, _, labels in POINTS} | {
        ("export.dropped_total", ())
    }
    assert all(scan_key not in r.values for r in steps)
    assert all(("export.dropped_total", ()) in r.values for r in steps)


def test_a_job_of_several_rank_blocks_keys_its_step_tier_by_block_and_its_detail_whole():
    """World 4 in blocks of 2: rank 1's step-tier messages name block 0 (a step's blocks
    spread over the partitions); its scan-tier detail and ring dumps keep run:step (one
    worker gathers a detail step whole); a job within one block keeps run:step."""
    main, detail = MemoryTransport(), MemoryTransport()
    emitter = StepEmitter(IDENTITY, main, detail=detail, block_ranks=2, ring_steps=2)
    emitter.emit(0, POINTS)
    emitter.emit(1, POINTS, held=True)
    assert emitter.flush(5.0)
    emitter.dump()
    emitter.close()
    assert [k for k, _ in main.messages] == [b"run1:0:0", b"run1:1:0"]
    assert [k for k, _ in detail.messages] == [b"run1:0", b"run1:1"]
    whole = MemoryTransport()
    emitter = StepEmitter(IDENTITY, whole, block_ranks=4)
    emitter.emit(0, POINTS)
    emitter.close()
    assert [k for k, _ in whole.messages] == [b"run1:0"]
    assert decode_rank_step(*main.messages[0]).rank == 1  # the block key decodes


def test_messages_undelivered_at_close_are_counted_and_said_never_dropped_silently(caplog):
    """No broker at the address: what the producer still holds at close is counted as
    failed and named in one warning (the rank exits; those messages are gone)."""
    from probewire.deploy.stack import free_port
    from probewire.instrument import KafkaTransport

    port = free_port()  # a loopback port nothing listens on
    transport = KafkaTransport(
        {"bootstrap.servers": f"127.0.0.1:{port}", "message.timeout.ms": "60000"}, "otlp_metrics"
    )
    assert all(transport.send(b"run:%d" % i, b"x") for i in range(3))
    assert transport.flush(0.2) == 3
    with caplog.at_level("WARNING", logger="probewire.instrument.export"):
        transport.close()
    assert transport.failed == 3
    assert [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()] == [
        "probewire: 3 message(s) to otlp_metrics not delivered at close (no broker reached); "
        "they are lost"
    ]
