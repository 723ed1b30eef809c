"""OTLP to a site's own OpenTelemetry Collector: the same ``ExportMetricsServiceRequest`` a
rank puts on Kafka, sent with the stock ``opentelemetry-exporter-otlp`` clients (HTTP/protobuf
or gRPC), with their retries, TLS, headers and compression.

A Collector whose ``kafka`` exporter writes ``otlp_proto`` to the ``otlp_metrics`` topic
feeds the same stream (``deploy/otelcol/collector.yaml``): one request per message, so the
pipeline must not batch requests together; the worker reads each message by its content
and ignores the Collector's key.

The stock exporters take SDK ``MetricsData``; the rank already has the serialised request,
so these transports hand it to the exporters' request-level calls (``_export_batch`` of the
HTTP exporter; the gRPC exporter with its translation made the identity). Both are private
to opentelemetry-exporter-otlp 1.45.2, which the package pins.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

__all__ = ["OtlpTransport"]

log = logging.getLogger(__name__)


class OtlpTransport:
    """A ``Transport`` (``export.Transport``) to an OTLP endpoint; ``send`` never raises.

    ``protocol`` "http" posts to ``endpoint`` (``http://collector:4318/v1/metrics``);
    "grpc" calls the metrics service at ``endpoint`` (``collector:4317``).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        protocol: str = "http",
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
        insecure: bool = True,
    ) -> None:
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        self.protocol = protocol
        self.failed = 0
        if protocol == "http":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter,
            )

            self._exporter = OTLPMetricExporter(
                endpoint=endpoint, headers=dict(headers or {}), timeout=timeout_s
            )
            self._send = self._exporter._export_batch
        else:
            self._exporter = _grpc_exporter(endpoint, dict(headers or {}), timeout_s, insecure)
            self._send = self._exporter._export

    def send(self, key: bytes, value: bytes) -> bool:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
            ExportMetricsServiceRequest,
        )
        from opentelemetry.sdk.metrics.export import MetricExportResult

        try:
            ok = (
                self._send(ExportMetricsServiceRequest.FromString(value))
                is MetricExportResult.SUCCESS
            )
        except Exception as exc:  # contained: a broken endpoint never reaches the loop
            log.warning("probewire: OTLP export failed: %s", exc)
            ok = False
        self.failed += not ok
        return ok

    def flush(self, timeout_s: float) -> int:
        return 0  # every send completed (or failed) before it returned

    def close(self) -> None:
        self._exporter.shutdown()


def _grpc_exporter(endpoint: str, headers: dict[str, str], timeout_s: float, insecure: bool):
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    class RequestExporter(OTLPMetricExporter):
        """Exports an already serialised request as it is."""

        def _translate_data(self, data):  # type: ignore[override]
            return data

        def _count_data(self, data) -> int:  # type: ignore[override]
            return sum(
                len(m.gauge.data_points)
                for rm in data.resource_metrics
                for sm in rm.scope_metrics
                for m in sm.metrics
            )

    return RequestExporter(endpoint=endpoint, insecure=insecure, headers=headers, timeout=timeout_s)
