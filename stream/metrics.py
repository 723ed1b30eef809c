"""The worker's ``/metrics`` page (Prometheus text, ``prometheus-client``): what the
chart's ServiceMonitor scrapes (``metrics.port`` / ``metrics.path``).

- ``probewire_consumer_lag{topic,partition}``: the partition's high watermark less the
  next offset this worker will read (what waits in the broker for it);
- ``probewire_steps_stored_total{run_id}``: steps the store took (the heartbeat's count);
- ``probewire_dead_letters_total``: dead letters sent;
- ``probewire_store_write_seconds``: the store write of one batch (a histogram);
- ``probewire_healthy``: 1 while ``probewire health`` would pass on the verdict.

Served by ``prometheus_client``'s own HTTP thread on ``stream.web_bind`` (loopback by
default) and ``stream.metrics_port`` (0: off). The collector reads the worker's counters
when scraped; nothing is computed on the event loop for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["WorkerMetrics"]

log = logging.getLogger(__name__)


class _Snapshot(Collector):
    """Metric families built, when scraped, from ``read()``: (lag by (topic, partition),
    steps stored by run, dead letters, healthy)."""

    def __init__(self, read: Callable[[], tuple[Mapping, Mapping, int, bool]]) -> None:
        self.read = read

    def collect(self) -> Iterable[Any]:
        lag, stored, dead, healthy = self.read()
        gauge = GaugeMetricFamily(
            "probewire_consumer_lag",
            "messages in the partition not yet read by this worker",
            labels=["topic", "partition"],
        )
        for (topic, partition), n in sorted(lag.items()):
            gauge.add_metric([topic, str(partition)], max(0, n))
        yield gauge
        steps = CounterMetricFamily(
            "probewire_steps_stored", "steps the store took", labels=["run_id"]
        )
        for run_id, n in sorted(stored.items()):
            steps.add_metric([run_id], n)
        yield steps
        yield CounterMetricFamily("probewire_dead_letters", "dead letters sent", value=dead)
        yield GaugeMetricFamily("probewire_healthy", "1: the health verdict passes", value=healthy)


class WorkerMetrics:
    """The registry of one worker and its write-latency histogram; ``serve`` starts the
    page (an OSError, a port in use, is logged: the worker runs on without it)."""

    def __init__(self, read: Callable[[], tuple[Mapping, Mapping, int, bool]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_Snapshot(read))
        self.write_seconds = Histogram(
            "probewire_store_write_seconds",
            "store write of one batch",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )

    def serve(self, bind: str, port: int) -> None:
        if not port:
            return
        try:
            start_http_server(port, addr=bind, registry=self.registry)
        except OSError as exc:
            log.error("probewire: no /metrics: cannot serve on %s:%d (%s)", bind, port, exc)
            return
        log.info("probewire: metrics on http://%s:%d/metrics", bind, port)
