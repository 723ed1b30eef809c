"""Asynchronous OTLP export: one ``ExportMetricsServiceRequest`` per rank per step into Kafka.

The training thread only enqueues a step record (a bounded queue; what it cannot hold is
counted, never blocks). One background thread per rank owns everything else: it resolves
the record (waits for the device-to-host copy of the step's statistics, turns them into
points), encodes OTLP (see ``wire``) and hands the bytes to a transport (Kafka, key
``<run_id>:<step>``).

Two paths (``detail``): with a detail transport, a step's catalog scan-tier points leave
as their own message on it (the ``otlp_detail`` topic), apart from the step tier that the
stream's P0 view, detectors and pages read; a ring dump's and a replay's messages go there
too. The stream reduces and stores the detail on its own, so a huge scan step never delays
its step's page. Without one, a step is one message, as it was.

The ring buffer holds what was measured and **not** sent: on a step measured for the ring
only (``ProbeConfig.ring_every``, a record with ``held``), the catalog's scan-tier points
stay in the ring and the rest of the step is sent. The ring keeps the last ``ring_steps``
such steps (a deque with a maximum length: its memory is bounded by ``ring_steps`` steps of
scan points). A ``dump`` (control topic) sends each held step once, as a message marked
replay (``wire.REPLAY_ATTR``), and empties the ring: a second dump sends nothing already
sent. A replay's record (``Monitor.replay``) sends its scan-tier points the same way,
marked replay, and nothing else. Nothing here keeps state per step beyond the bounded
queue and ring.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .catalog import CATALOG, Export, Tier
from .kafkalog import kafka_log
from .wire import Point, RankIdentity, WireEncoder, message_key

__all__ = [
    "KafkaTransport",
    "StepEmitter",
    "StepRecord",
    "Transport",
    "split_held",
]

log = logging.getLogger(__name__)

_SCAN_TIER = frozenset(name for name, s in CATALOG.items() if s.tier is Tier.SCAN)


def split_held(points: Sequence[Point]) -> tuple[list[Point], list[Point]]:
    """(sent, held) of a step measured for the ring: held = the catalog's scan-tier points."""
    sent: list[Point] = []
    held: list[Point] = []
    for point in points:
        (held if point[0] in _SCAN_TIER else sent).append(point)
    return sent, held


class Transport(Protocol):
    """Where encoded messages go. ``send`` never raises; it returns False on failure."""

    def send(self, key: bytes, value: bytes) -> bool: ...

    def flush(self, timeout_s: float) -> int: ...

    def close(self) -> None: ...


class StepRecord(Protocol):
    """One step's measurements as the training thread hands them over.

    ``resolve`` runs on the emitter thread: it may wait for a device copy, sample host
    counters, and returns the points (it must not touch the training thread's state).
    """

    step: int
    held: bool  # scan-tier points go to the ring instead of the transport

    def resolve(self) -> list[Point]: ...


@dataclass(slots=True)
class _Ready:
    step: int
    points: list[Point]
    held: bool = False

    def resolve(self) -> list[Point]:
        return self.points


class KafkaTransport:
    """confluent-kafka producer (it reports delivery failures that aiokafka hides)."""

    def __init__(self, client_config: Mapping[str, str], topic: str) -> None:
        from confluent_kafka import KafkaException, Producer

        self._errors = (BufferError, KafkaException)
        self._topic = topic
        self._client_config = dict(client_config)
        self._stuck = False
        # one request in flight: a retried batch cannot overtake a later one, so a rank's
        # steps stay in order within a partition (stage 1 relies on that order)
        self._producer = Producer(
            {
                **client_config,
                "linger.ms": "5",
                "acks": "all",
                "enable.idempotence": "false",
                "max.in.flight.requests.per.connection": "1",
                # murmur2 (the Java client's): librdkafka's default crc32 is linear, so the
                # keys run:step:0..3 of one step's rank blocks fell in one partition
                "partitioner": "murmur2_random",
                "logger": kafka_log,
            }
        )  # librdkafka's messages: logging (one line a minute), not fd 2
        self.failed = 0

    def _on_delivery(self, err: object, _msg: object) -> None:
        if err is not None:
            self.failed += 1
            kafka_log.warning("probewire: delivery failed: %s", err)

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
        left = self._producer.flush(timeout_s)
        self._stuck = left > 0  # undeliverable now (no broker): close() waits no longer
        return left

    def close(self) -> None:
        """Deliver what is pending (up to 10 s; none when the last flush found no broker).
        What is still undelivered then is lost with the producer: counted in ``failed``
        and said in one warning, never dropped silently."""
        left = self.flush(0.0 if self._stuck else 10.0)
        if left:
            self.failed += left
            log.warning(
                "probewire: %d message(s) to %s not delivered at close (no broker "
                "reached); they are lost",
                left,
                self._topic,
            )

    def to_topic(self, topic: str) -> KafkaTransport:
        """A transport with this one's client settings to another topic (its own producer)."""
        return KafkaTransport(self._client_config, topic)


class StepEmitter:
    """Owns the pending records, the thread, the ring buffer and the encoder of one rank.

    Hand-off without a wake-up: ``submit`` appends to a bounded deque (no lock, no
    notify). The emitter thread wakes every ``idle_s`` (or on ``kick``, or when the deque
    is half full) and drains everything pending in one burst. Waking once per step instead
    — worse, from inside the backward pass, which takes the GIL to free tensors — made the
    emitter's Python work compete with the training thread for the GIL: measured on the
    2-core CPU demo, per-step wake-ups cost the step 6-13 %, bursts every 50 ms ~0.
    """

    def __init__(
        self,
        identity: RankIdentity,
        transport: Transport,
        *,
        detail: Transport | None = None,
        block_ranks: int = 256,
        queue_size: int = 256,
        ring_steps: int = 0,
        idle_s: float = 0.05,
    ) -> None:
        if queue_size < 1 or ring_steps < 0:
            raise ValueError("queue_size must be >= 1 and ring_steps >= 0")
        self.identity = identity
        self._transport = transport
        self._detail = detail  # the scan-tier points' own topic (None: with the step)
        self._pending: collections.deque[StepRecord] = collections.deque()
        self._queue_size = queue_size
        self._wake = threading.Event()
        self._idle_s = idle_s
        self._stop = False
        self._dump_requests = 0
        self.dropped = 0  # steps the training thread could not enqueue
        self.sent = 0
        self.errors = 0
        self.replayed = 0  # held steps sent from the ring buffer on a dump
        self.ring: collections.deque[tuple[int, list[Point]]] = collections.deque(
            maxlen=max(ring_steps, 1)
        )  # held (unsent) scan-tier points of the last steps
        self._keep_ring = ring_steps > 0
        self._encoder = WireEncoder(identity.resource_attributes())
        # a job of more than one rank block names this rank's block in its messages' keys
        many = identity.world_size > block_ranks
        self._block = identity.rank // block_ranks if many else None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="probewire-emitter", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ training thread
    def emit(self, step: int, points: Iterable[Point], held: bool = False) -> None:
        """Enqueue ready points and return. A full queue drops the step and counts it.
        ``held``: the scan-tier points go to the ring buffer, the rest is sent."""
        self.submit(_Ready(int(step), list(points), held))

    def submit(self, record: StepRecord) -> None:
        """Enqueue a step record (resolved on the emitter thread). Never blocks."""
        pending = len(self._pending)
        if pending >= self._queue_size:
            self.dropped += 1
            return
        self._pending.append(record)
        if pending * 2 >= self._queue_size:
            self.kick()

    def kick(self) -> None:
        """Let the emitter thread work now (cheap when it is already awake)."""
        if not self._wake.is_set():
            self._wake.set()

    # ------------------------------------------------------------------ any thread
    def dump(self) -> None:
        """Ask the emitter thread to send the ring buffer's held steps, once each."""
        self._dump_requests += 1
        self._wake.set()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every record submitted and every dump asked for so far is sent; True
        when drained in time."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        while (self._pending or self._dump_requests or self._busy) and time.monotonic() < deadline:
            time.sleep(0.005)
            self._wake.set()
        return not (self._pending or self._dump_requests)

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain what is pending, flush the transport, stop the thread. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self._wake.set()
        deadline = time.monotonic() + timeout_s  # the join and the flush share the wait
        self._thread.join(timeout_s)
        for transport in self._transports():
            transport.flush(max(0.0, deadline - time.monotonic()))
            transport.close()

    def _transports(self) -> list[Transport]:
        return [self._transport] if self._detail is None else [self._detail, self._transport]

    # ------------------------------------------------------------------ emitter thread
    _busy = False

    def _send(
        self, step: int, points: Sequence[Point], replay: bool = False, detail: bool = False
    ) -> None:
        """Encode and send one message: the step tier (with the drop counter), or with
        ``detail`` the scan-tier points alone (to the detail transport, when there is one)."""
        if not (replay or detail):
            points = [*points, Point(Export.DROPPED, float(self.dropped))]
        try:
            payload = self._encoder.encode(step, points, replay=replay)
        except Exception:  # contained: a broken batch must never reach the training loop
            self.errors += 1
            log.exception("probewire: could not encode step %d", step)
            return
        # the step tier's rank blocks spread over stage-1 workers; the detail (and a replay)
        # is gathered whole by one worker (``stream.assemble``: keyed by run and step)
        block = None if replay or detail else self._block
        key = message_key(self.identity.run_id, step, block)
        transport = self._detail if detail and self._detail is not None else self._transport
        if transport.send(key, payload):
            self.sent += 1
        else:
            self.errors += 1

    def _drain(self) -> None:
        while self._pending:
            record = self._pending.popleft()
            try:
                points = record.resolve()
            except Exception:  # contained, as above
                self.errors += 1
                log.exception("probewire: could not resolve step %s", getattr(record, "step", "?"))
                continue
            if getattr(record, "replay", False):  # a replay's detail (``step.ReplayContext``)
                _, detail = split_held(points)
                if detail:
                    self._send(record.step, detail, replay=True, detail=True)
                continue
            if getattr(record, "held", False) and self._keep_ring:
                points, held = split_held(points)
                if held:
                    self.ring.append((record.step, held))
                self._send(record.step, points)
            elif self._detail is not None:  # the step tier first: it is what pages
                points, scan = split_held(points)
                self._send(record.step, points)
                if scan:
                    self._send(record.step, scan, detail=True)
            else:
                self._send(record.step, points)
        while self._dump_requests:
            self._dump_requests -= 1
            while self.ring:  # each held step leaves the ring as it is sent: once
                step, points = self.ring.popleft()
                self._send(step, points, replay=True, detail=True)
                self.replayed += 1

    def _run(self) -> None:
        while True:
            self._wake.wait(self._idle_s)
            self._wake.clear()
            self._busy = True  # set before looking at the deque, so flush() never misses work
            try:
                self._drain()
            finally:
                self._busy = False
            if self._stop:
                self._drain()
                return
