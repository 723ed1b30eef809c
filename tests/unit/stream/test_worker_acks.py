"""When stage 1 acknowledges a rank message (``Worker._gather``): a re-read of a message
whose step is still gathering (the same offset, delivered again after a rebalance seeks
back to the committed offset) is acknowledged with that step, never before it, so no
commit passes a rank message whose step is not yet published. And what a gathering step
means to the worker's tick: no full garbage collection meanwhile (``collector``). Real
decoding, validation and assembly; the broker is a recording stand-in (nothing connects)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

from probewire.instrument.catalog import Loss
from probewire.instrument.plumbing import TopicConfig
from probewire.instrument.wire import Point, RankIdentity, WireEncoder, message_key
from probewire.stream.config import StreamConfig
from probewire.stream.worker import Worker


@dataclass
class _Message:
    topic: str
    partition: int
    offset: int


@dataclass
class _Event:
    key: bytes
    value: bytes
    message: _Message
    acked: list[int] = field(default_factory=list)

    def ack(self) -> None:
        self.acked.append(self.message.offset)


class _Publisher:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send(self, topic: str, key: bytes, value: bytes) -> None:
        self.sent.append(key)


def _worker(tmp_path: Path) -> Worker:
    """A worker whose publisher records what it is sent, ready to gather."""
    worker = Worker(
        StreamConfig(),
        TopicConfig(),
        _Publisher,
        lambda: None,  # type: ignore[arg-type, return-value]
        tmp_path / "hb",
    )
    worker.publisher = _Publisher()  # type: ignore[assignment]
    worker.publishing.set()
    return worker


def _event(rank: int, offset: int, step: int = 0) -> _Event:
    who = RankIdentity(run_id="r", rank=rank, world_size=2, host="h", coords={"dp": rank})
    points = [Point(Loss.SUM, 3.0), Point(Loss.TOKENS, 1.0)]
    value = WireEncoder(who.resource_attributes()).encode(step, points)
    return _Event(message_key("r", step), value, _Message("otlp_metrics", 0, offset))


def test_a_re_read_message_of_a_gathering_step_is_acknowledged_with_the_step(
    tmp_path: Path,
) -> None:
    async def main() -> tuple[_Event, _Event, _Event, _Publisher]:
        worker = _worker(tmp_path)
        publisher = worker.publisher
        first, again, other = _event(0, 5), _event(0, 5), _event(1, 6)
        await worker._gather(first)
        await worker._gather(again)  # rank 0's message read again: step 0 still gathers
        assert first.acked == [] and again.acked == []
        await worker._gather(other)  # rank 1: step 0 complete, published, then acked
        await asyncio.gather(*worker._unconfirmed)
        return first, again, other, publisher

    first, again, other, publisher = asyncio.run(main())
    assert publisher.sent == [b"r"]
    assert (first.acked, again.acked, other.acked) == ([5], [5], [6])


def test_a_re_read_message_of_a_published_step_is_acknowledged_at_once(tmp_path: Path) -> None:
    async def main() -> _Event:
        worker = _worker(tmp_path)
        await worker._gather(_event(0, 5))
        await worker._gather(_event(1, 6))
        await asyncio.gather(*worker._unconfirmed)
        late_copy = _event(1, 6)
        await worker._gather(late_copy)
        return late_copy

    assert asyncio.run(main()).acked == [6]


def test_a_worker_collects_on_its_tick_only_while_no_step_is_in_hand(tmp_path: Path) -> None:
    async def main() -> list[str]:
        worker = _worker(tmp_path)
        seen: list[str] = []
        collector = worker.collector
        collector.collect = lambda: seen.append("collected")
        # started 30 s ago: due when idle (every_s 10), not yet forced (max_s 60)
        collector.started, collector.last = True, collector.clock() - 30
        await worker._gather(_event(0, 5))  # rank 0 of 2: step 0 gathering
        await worker.tick()
        seen.append("tick while gathering")
        worker.assembler.drop_pending()
        worker._tier_seen = 0.0  # and its last input long ago
        await worker.tick()
        return seen

    assert asyncio.run(main()) == ["tick while gathering", "collected"]
