"""OTLP to a Collector through the stock exporters: a loopback HTTP and gRPC endpoint
receive exactly the requests the Kafka transport would carry for the same steps."""

from __future__ import annotations

import http.server
import math
import threading
from concurrent import futures

import pytest
import torch
import torch.nn.functional as F

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.otlp_collector import OtlpTransport
from probewire.instrument.wire import decode_rank_step


def train(transport, steps: int = 3) -> None:
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(seq_len=8, d_model=16, n_layer=1, n_head=2))
    monitor = attach(
        model,
        None,
        transport=transport,
        identity=RankIdentity(run_id="otel", rank=0, world_size=1, host="h"),
        config=ProbeConfig(telemetry=False, comm=False, clip_threshold=1.0),
    )
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        tokens = torch.randint(0, 256, (2, 8), generator=g)
        with monitor.step(step) as s:
            s.micro_batch(tokens=tokens)
            losses = F.cross_entropy(model(tokens).transpose(1, 2), tokens, reduction="none")
            s.loss(losses if step != 1 else losses * math.nan)
            losses.mean().backward()
            s.clip_grad_norm_(model.parameters(), 1.0)
            model.zero_grad()
    monitor.close()


def comparable(record):
    return (
        record.run_id,
        record.step,
        record.rank,
        {
            k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
            for k, v in record.values.items()
            if not k[0].startswith(("step.duration", "memory.", "export."))
        },
    )


@pytest.fixture()
def http_endpoint():
    bodies: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            return None

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/v1/metrics", bodies
    server.shutdown()
    server.server_close()


@pytest.fixture()
def grpc_endpoint():
    import grpc
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2 as pb
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2_grpc as rpc

    bodies: list[bytes] = []

    class Service(rpc.MetricsServiceServicer):
        def Export(self, request, context):  # noqa: N802
            bodies.append(request.SerializeToString())
            return pb.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rpc.add_MetricsServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", bodies
    server.stop(0)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_collector_receives_what_kafka_would_carry(protocol, http_endpoint, grpc_endpoint):
    endpoint, bodies = http_endpoint if protocol == "http" else grpc_endpoint
    kafka = MemoryTransport()
    train(kafka)
    train(OtlpTransport(endpoint, protocol=protocol))
    assert len(bodies) == len(kafka.messages) == 3
    sent = [comparable(decode_rank_step(None, body)) for body in bodies]
    carried = [comparable(decode_rank_step(key, value)) for key, value in kafka.messages]
    assert sent == carried


def test_an_unreachable_collector_is_counted_never_raised():
    transport = OtlpTransport("http://127.0.0.1:9/v1/metrics", timeout_s=0.5)
    assert transport.send(b"k", b"") is False and transport.failed == 1
