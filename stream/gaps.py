"""Rank messages a consumer skipped: read them again by offset.

Tansu 0.6 (the embedded broker), when two producers write to one partition at the same
moment, can make the later offset readable before the earlier one; a consumer whose fetch
lands between them moves past the earlier record and never sees it (measured: 1 record in
6,000 in one run of three, two producers writing each key together, as DDP ranks end a step
together; read again by offset, the record is there). Stage 1 keys a step's messages to one
partition, so that is exactly how its ranks write, and the step was stored without a rank.

``GapWatch`` notices an offset that jumps past the next one in a partition; the worker
then reads the offsets in between with ``GapReader`` (a consumer that joins no group) before
the message after the gap, so the order stage 1 relies on holds. On a Kafka broker a gap
is a transaction marker or a compacted record: the read finds nothing and costs one fetch.
Before the first message a worker reads in a partition (after its start or a rebalance)
the previous offset is the one its consumer group starts from: on each assignment,
``GapReader.starts`` asks the broker for it (the group's committed offset, else the
partition's first), while the new partitions are still paused.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

__all__ = ["GapReader", "GapWatch", "Refetched"]


class GapWatch:
    """The last offset read in each partition; ``gap`` names the offsets skipped.

    Only a short gap (at most ``max_gap`` offsets) is one the broker skipped; a longer
    jump is a partition that another worker read meanwhile. ``forget`` (partitions
    revoked) starts every partition's count again, ``begin`` (partitions assigned) from
    the offset the consumer reads first."""

    def __init__(self, max_gap: int = 64) -> None:
        self._last: dict[int, int] = {}
        self._max_gap = max_gap

    def begin(self, partition: int, offset: int) -> None:
        """The consumer reads ``partition`` from ``offset``: a first message past it
        follows a gap."""
        self._last[partition] = offset - 1

    def gap(self, partition: int, offset: int) -> tuple[int, int] | None:
        """[start, end) skipped before ``offset``, or None. A redelivery (an offset at or
        before the last one) starts the partition's count again."""
        last = self._last.get(partition)
        self._last[partition] = offset
        if last is None or offset <= last + 1 or offset - last - 1 > self._max_gap:
            return None
        return last + 1, offset

    def forget(self) -> None:
        self._last.clear()


@dataclass(frozen=True, slots=True)
class _Message:
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True, slots=True)
class Refetched:
    """A message read again by offset, shaped as the Faust event stage 1 handles; nothing
    to acknowledge (the consumer counted its offset as a gap)."""

    key: bytes | None
    value: bytes | None
    message: _Message

    def ack(self) -> None:
        return None


class GapReader:
    """Reads given offsets of one partition with its own consumer (confluent-kafka). It
    names the worker's consumer group, to read the group's committed offsets, but never
    joins it (it assigns partitions itself) and commits nothing. Blocking: run it in an
    executor."""

    def __init__(
        self, client_config: Mapping[str, str], group_id: str, wait_s: float = 1.0
    ) -> None:
        from confluent_kafka import Consumer

        # a short fetch wait: Tansu answers a waiting fetch only at its deadline
        self._consumer = Consumer(
            {
                **client_config,
                "group.id": group_id,
                "enable.auto.commit": "false",
                "fetch.wait.max.ms": "10",
            }
        )
        self._wait_s = wait_s

    def starts(self, topic: str, partitions: Iterable[int]) -> dict[int, int]:
        """Where the group reads each partition from after an assignment: its committed
        offset, else the partition's first (the worker starts a new group at the earliest
        offset). The broker has ``wait_s`` in all (the caller holds a rebalance open);
        a partition it has not answered for by then is left out."""
        from confluent_kafka import KafkaException, TopicPartition

        deadline = time.monotonic() + self._wait_s
        try:
            committed = self._consumer.committed(
                [TopicPartition(topic, p) for p in partitions], timeout=self._wait_s
            )
        except KafkaException:
            return {}
        found: dict[int, int] = {}
        for tp in committed:
            left = deadline - time.monotonic()
            if tp.error is None and tp.offset >= 0:
                found[tp.partition] = tp.offset
            elif left > 0:
                try:
                    found[tp.partition], _ = self._consumer.get_watermark_offsets(
                        TopicPartition(topic, tp.partition), timeout=left
                    )
                except KafkaException:
                    pass
        return found

    def read(self, topic: str, partition: int, start: int, end: int) -> list[Refetched]:
        """The records at offsets [start, end), as many as appear within ``wait_s``."""
        from confluent_kafka import TopicPartition

        self._consumer.assign([TopicPartition(topic, partition, start)])
        found: dict[int, Refetched] = {}
        deadline = time.monotonic() + self._wait_s
        while time.monotonic() < deadline:
            for m in self._consumer.consume(end - start, 0.05):
                if m.error() is None and start <= m.offset() < end:
                    found[m.offset()] = Refetched(
                        m.key(), m.value(), _Message(topic, partition, m.offset())
                    )
                if m.error() is None and m.offset() >= end - 1:
                    deadline = 0.0  # read up to the gap's end: whatever is missing is gone
        self._consumer.unassign()
        return [found[o] for o in sorted(found)]

    def close(self) -> None:
        self._consumer.close()
