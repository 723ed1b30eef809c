"""The worker's publisher on the real broker: every ``send`` returns once the broker holds its
message, and what it confirmed is in the topic, once each, in order per partition."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from confluent_kafka import Consumer

from probewire.deploy.stack import create_topics
from probewire.stream.publish import Publisher, PublishError

pytestmark = pytest.mark.integration


def _read_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 30.0) -> list:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"pub-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 6000,
            "fetch.wait.max.ms": 50,
        }
    )
    consumer.subscribe([topic])
    found = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(found) < expected and time.monotonic() < deadline:
            for message in consumer.consume(500, timeout=0.5):
                if message.error() is None:
                    found.append((message.key(), message.value()))
    finally:
        consumer.close()
    return found


def test_concurrent_sends_all_return_once_the_broker_holds_them(kafka_bootstrap):
    topic = f"pub-{uuid.uuid4().hex[:8]}"
    create_topics(kafka_bootstrap, {topic: 1})
    publisher = Publisher({"bootstrap.servers": kafka_bootstrap}, 100_000)
    sent = [(f"k{i % 7}".encode(), f"value {i}".encode()) for i in range(400)]

    async def main() -> list:
        return await asyncio.wait_for(
            asyncio.gather(*(publisher.send(topic, key, value) for key, value in sent)), 60
        )

    try:
        assert asyncio.run(main()) == [None] * len(sent)
        with pytest.raises(PublishError, match="over the limit"):  # refused before the broker
            asyncio.run(publisher.send(topic, b"k", b"x" * 100_001))
    finally:
        assert publisher.close() == 0
    assert _read_all(kafka_bootstrap, topic, len(sent)) == sent  # one partition: in order


def test_sends_from_two_event_loops_in_turn_each_return(kafka_bootstrap):
    """Each report reaches the loop that sent its message (a test or a restarted worker
    makes a new loop; the publisher outlives it)."""
    topic = f"pub-{uuid.uuid4().hex[:8]}"
    create_topics(kafka_bootstrap, {topic: 2})
    publisher = Publisher({"bootstrap.servers": kafka_bootstrap}, 100_000)

    async def burst(tag: str) -> list:
        return await asyncio.wait_for(
            asyncio.gather(
                *(publisher.send(topic, tag.encode(), f"{tag}{i}".encode()) for i in range(50))
            ),
            60,
        )

    try:
        assert asyncio.run(burst("a")) == [None] * 50
        assert asyncio.run(burst("b")) == [None] * 50
    finally:
        assert publisher.close() == 0
    values = sorted(v for _, v in _read_all(kafka_bootstrap, topic, 100))
    assert values == sorted(
        [f"a{i}".encode() for i in range(50)] + [f"b{i}".encode() for i in range(50)]
    )


def test_the_gap_reader_reads_given_offsets_of_a_partition_and_nothing_past_its_end(
    kafka_bootstrap,
):
    """What the worker reads again when its consumer skipped offsets (``stream.gaps``)."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from probewire.stream.gaps import GapReader

    topic = f"gaps-{uuid.uuid4().hex[:8]}"
    create_topics(kafka_bootstrap, {topic: 1})
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 0})
    for i in range(6):
        producer.produce(topic, key=b"run:%d" % i, value=b"v%d" % i)
        producer.flush(10)  # one record a batch: offsets 0..5
    group = f"gaps-group-{uuid.uuid4().hex[:8]}"
    reader = GapReader({"bootstrap.servers": kafka_bootstrap}, group, wait_s=2.0)
    try:
        assert reader.starts(topic, [0]) == {0: 0}  # nothing committed: the first offset
        got = reader.read(topic, 0, 2, 5)
        assert [(m.key, m.value, m.message.offset) for m in got] == [
            (b"run:2", b"v2", 2),
            (b"run:3", b"v3", 3),
            (b"run:4", b"v4", 4),
        ]
        assert got[0].message.topic == topic and got[0].message.partition == 0
        started = time.monotonic()
        assert reader.read(topic, 0, 6, 8) == []  # nothing there: gone, after wait_s
        assert time.monotonic() - started < 5.0
        committer = Consumer(
            {"bootstrap.servers": kafka_bootstrap, "group.id": group, "enable.auto.commit": "false"}
        )
        try:  # the group's committed offset, as a worker's consumer commits it
            committer.commit(offsets=[TopicPartition(topic, 0, 4)], asynchronous=False)
        finally:
            committer.close()
        assert reader.starts(topic, [0]) == {0: 4}
    finally:
        reader.close()
