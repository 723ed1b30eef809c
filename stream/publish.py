"""Publishing from the worker with a delivery report for every message.

The worker's outputs (reduced steps, alerts, control messages, dead letters) go through a
confluent-kafka producer, not Faust's: aiokafka reports success for a topic that vanished
with a restarted broker, librdkafka does not. ``send`` returns once the broker has the
message, retries a retriable failure (broker down, topic missing, timeout) until it
succeeds, and raises ``PublishError`` only for a failure that retrying cannot fix (a
message over the broker's size limit, say). The caller acknowledges its input only after
``send`` returned.

``broker_message_limit`` reads the limit the broker states for the worker's output topics
and ``check_message_limit`` refuses, at start, a ``stream.max_message_bytes`` above it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from probewire.instrument.plumbing import check

__all__ = [
    "RECORD_OVERHEAD_BYTES",
    "PublishError",
    "Publisher",
    "broker_message_limit",
    "check_message_limit",
]

RECORD_OVERHEAD_BYTES = 1024
"""What a message needs beyond its value in the broker's accounting: the record batch
header, the record's framing and its key (a run id)."""

log = logging.getLogger(__name__)


class PublishError(RuntimeError):
    """A message the broker will never take; ``reason`` goes to the dead letter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Publisher:
    """One producer with a polling thread; ``send`` is awaited from the event loop."""

    def __init__(
        self,
        client_config: dict[str, str],
        max_message_bytes: int,
        *,
        timeout_s: float = 20.0,
        retry_max_s: float = 5.0,
        on_retry: Callable[[str], None] | None = None,
    ) -> None:
        self._producer = Producer(
            {
                **client_config,
                "message.max.bytes": max_message_bytes + 65_536,
                "linger.ms": 5,
                "acks": "all",
                "message.timeout.ms": int(timeout_s * 1000),
                "socket.timeout.ms": 5000,
            }
        )
        self.max_message_bytes = max_message_bytes
        self.retry_max_s = retry_max_s
        self.on_retry = on_retry or (lambda reason: None)
        self.retries = 0
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="probewire-publish", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._closed.is_set():
            self._producer.poll(0.05)

    async def send(self, topic: str, key: bytes | None, value: bytes) -> None:
        """Publish and wait for the broker's acknowledgement (see the module docstring)."""
        if len(value) > self.max_message_bytes:
            raise PublishError(
                f"message of {len(value)} bytes over the limit of "
                f"{self.max_message_bytes} (stream.max_message_bytes)"
            )
        delay = 0.1
        while True:
            error = await self._attempt(topic, key, value)
            if error is None:
                return
            if not _retriable(error):
                raise PublishError(f"publish to {topic} failed: {error.str()}")
            self.retries += 1
            reason = f"publish to {topic} failed ({error.str()}); retrying in {delay:.1f}s"
            log.warning("probewire: %s", reason)
            self.on_retry(reason)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.retry_max_s)

    async def _attempt(self, topic: str, key: bytes | None, value: bytes) -> KafkaError | None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def report(err: KafkaError | None, _msg: Any) -> None:
            loop.call_soon_threadsafe(_settle, done, err)

        while True:
            try:
                self._producer.produce(topic, value=value, key=key, on_delivery=report)
                break
            except BufferError:  # the local queue is full: let the poller drain it
                await asyncio.sleep(0.05)
            except KafkaException as exc:
                return exc.args[0]
        return await done

    def reachable(self, timeout_s: float) -> str:
        """Ask the broker for its metadata (blocking: call from a thread): "" when it
        answered within ``timeout_s``, else why not."""
        try:
            self._producer.list_topics(timeout=timeout_s)
        except KafkaException as exc:
            return str(exc.args[0].str() if exc.args else exc)
        return ""

    def close(self, timeout_s: float = 10.0) -> int:
        """Flush what is queued; returns how many messages are still undelivered."""
        left = self._producer.flush(timeout_s)
        self._closed.set()
        self._thread.join(2.0)
        return left


_PERMANENT = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.INVALID_MSG_SIZE,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.INVALID_RECORD,
    }
)


def _settle(done: asyncio.Future[Any], err: KafkaError | None) -> None:
    """Resolve the delivery future with the report's error, once (a late report is moot)."""
    if not done.done():
        done.set_result(err)


def _retriable(error: KafkaError) -> bool:
    return error.code() not in _PERMANENT and not error.fatal()


def broker_message_limit(
    client_config: dict[str, str], topics: Sequence[str], timeout_s: float = 10.0
) -> tuple[int, str] | None:
    """The smallest ``max.message.bytes`` the broker states for ``topics`` (a topic's own,
    which defaults to the broker's ``message.max.bytes``), with its topic. None when the
    broker states none or does not answer (Tansu states only what a topic was created
    with): then nothing can be checked, and a warning says so."""
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    admin = AdminClient(dict(client_config))
    resources = [ConfigResource(ResourceType.TOPIC, topic) for topic in topics]
    found: list[tuple[int, str]] = []
    try:
        futures = admin.describe_configs(resources, request_timeout=timeout_s)
    except KafkaException as exc:
        log.warning("probewire: cannot read the topics' message limit: %s", exc)
        return None
    for resource, future in futures.items():
        try:
            entry = future.result(timeout_s).get("max.message.bytes")
        except (KafkaException, TimeoutError) as exc:
            log.warning("probewire: cannot read %s's message limit: %s", resource.name, exc)
            continue
        if entry is not None and str(entry.value).isdigit():
            found.append((int(entry.value), resource.name))
    if not found:
        log.warning(
            "probewire: the broker states no max.message.bytes for %s; "
            "stream.max_message_bytes is not checked against it",
            ", ".join(topics),
        )
    return min(found) if found else None


def check_message_limit(max_message_bytes: int, limit: tuple[int, str] | None) -> None:
    """A ConfigError (one line, with the fix) when a message of ``max_message_bytes`` does
    not fit the broker's ``limit``: the broker would refuse every part that size."""
    if limit is None:
        return
    largest, topic = limit
    fits = largest - RECORD_OVERHEAD_BYTES
    check(
        max_message_bytes <= fits,
        "stream.max_message_bytes",
        f"{max_message_bytes} is over what topic {topic} takes (max.message.bytes="
        f"{largest}, less {RECORD_OVERHEAD_BYTES} bytes of record overhead): set it to at "
        f"most {fits}, or raise the topic's max.message.bytes",
    )
