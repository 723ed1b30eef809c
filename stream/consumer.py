"""Where the worker's Kafka consumer differs from stock Faust, and why (both measured).

- A short fetch wait (``use_fetch_wait``): Tansu answers a waiting fetch only at its deadline.
- Delivery without four tasks per message (``Consumer.wait_first``): Faust's fetch loop hands
  each message to its topic's queue through ``wait_first(deliver, suspend_flow.wait())``,
  so that a rebalance (which sets ``suspend_flow``) can interrupt a delivery blocked on
  paused flow control. mode's ``wait_first`` wraps both awaitables and the service's
  stopped and crashed events in tasks and waits on all four: ~35-55 us a message on this
  machine, against ~0.2 us for a delivery that never blocks, which is nearly every one.
- The offset it commits (``Consumer._new_offset``, ``committable``): Faust commits the first
  run of consecutive acknowledged offsets even when the message at the committed offset
  itself is not acknowledged (its check is ``min(acked) - committed > 1``, and it skips the
  check while the committed offset is 0 or none). Stage 1 holds a step's rank messages
  unacknowledged until the step is published, so the first message of a pending step sat
  at the committed offset while later steps' messages were acknowledged, and the commit
  passed it: after a rebalance (or a restart) the partition's next reader started beyond
  it, and the step was stored without that rank (test_stage1_workers, once: a loss over 7
  of 8 ranks). Here a commit starts at the committed offset (else the first offset this
  consumer read in the partition) and never passes an unacknowledged message; offsets
  Faust counts as a gap (never delivered) count as acknowledged, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Sequence
from typing import Any

from faust.transport.drivers.aiokafka import Consumer as _FaustConsumer
from mode.services import WaitResults

__all__ = ["Consumer", "committable", "use_fetch_wait"]


def use_fetch_wait(ms: int) -> None:
    """Faust hard-codes aiokafka's ``fetch_max_wait_ms=1500``. Tansu (measured) answers a
    waiting fetch only at that deadline even when data arrives, adding up to 1.5 s per hop;
    a short wait costs a few idle fetches per second instead. Applies to this process."""
    import aiokafka

    base = getattr(aiokafka.AIOKafkaConsumer, "_probewire_base", aiokafka.AIOKafkaConsumer)

    class FetchWaitConsumer(base):  # type: ignore[misc, valid-type]
        _probewire_base = base

        def __init__(self, *topics: str, **kwargs: Any) -> None:
            kwargs["fetch_max_wait_ms"] = ms
            super().__init__(*topics, **kwargs)

    aiokafka.AIOKafkaConsumer = FetchWaitConsumer


def committable(acked: Sequence[int], start: int | None) -> int:
    """How many of the sorted offsets ``acked`` a commit covers: the run of consecutive
    offsets that begins at ``start`` (the next offset to commit); 0 when the message at
    ``start`` is not acknowledged or ``start`` is unknown."""
    if start is None or not acked or acked[0] > start:
        return 0
    n = 1
    while n < len(acked) and acked[n] == acked[n - 1] + 1:
        n += 1
    return n


class Consumer(_FaustConsumer):
    """Faust's aiokafka consumer whose ``wait_first`` runs its first awaitable inline and
    whose commit never passes an unacknowledged message."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._first_read: dict[Any, int] = {}  # where a commit starts while the group has none

    def track_message(self, message: Any) -> None:
        """Faust's, noting the first offset read in each partition."""
        self._first_read.setdefault(message.tp, message.offset)
        super().track_message(message)

    async def on_partitions_revoked(self, revoked: Any) -> None:
        for tp in revoked:
            self._first_read.pop(tp, None)
        await super().on_partitions_revoked(revoked)

    def _new_offset(self, tp: Any) -> int | None:
        """The offset to commit for ``tp`` (None: nothing new): Faust's, except that it
        starts at the committed offset and stops at the first message not acknowledged."""
        acked = self._acked[tp]
        if not acked:
            return None
        gaps, newest = self._gap[tp], max(acked)
        if gaps:  # offsets never delivered (Faust's gaps) count as acknowledged
            found = sorted(gaps.overlap(0, newest), key=lambda x: x.begin)
            if found:
                filled = [o for entry in found for o in range(entry.begin, entry.end)]
                acked.extend(filled)
                gaps.chop(0, max(filled[-1], newest + 1))
        acked.sort()
        start = self._committed_offset[tp]  # Faust keeps a committed 0 as None
        if start is None:
            start = self._first_read.get(tp)
        n = committable(acked, start)
        if not n:
            return None
        batch = acked[:n]
        acked[:n] = []
        self._acked_index[tp].difference_update(batch)
        return batch[-1] + 1

    async def wait_first(self, *coros: Any, timeout: Any = None) -> WaitResults:
        """mode's ``wait_first``, except that a first coroutine that finishes without
        suspending (a delivery into a queue with room, flow control active) wins at once
        and the others are closed unstarted: with mode's tasks it would have won too, as
        the first task to run. One that suspends (blocked on flow control) continues under
        mode's ``wait_first`` unchanged, so a rebalance interrupts it as before. An
        exception it raises propagates, as from mode's."""
        first, others = coros[0], coros[1:]
        if not asyncio.iscoroutine(first):
            return await super().wait_first(*coros, timeout=timeout)
        try:
            yielded = first.send(None)
        except StopIteration as done:
            _close(others)
            return WaitResults([first], [done.value], False)
        except BaseException:
            _close(others)
            raise
        return await super().wait_first(_Rest(first, yielded), *others, timeout=timeout)


def _close(awaitables: tuple[Any, ...]) -> None:
    for awaitable in awaitables:
        if asyncio.iscoroutine(awaitable):
            awaitable.close()


class _Rest:
    """The rest of a coroutine that already ran to its first suspension (``yielded``): an
    awaitable that hands the task driving it what the coroutine yields, and the coroutine
    what the task sends or throws back (``yield from`` after a first step taken outside)."""

    def __init__(self, coro: Any, yielded: Any) -> None:
        self.coro, self.yielded = coro, yielded

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, value = self.coro, self.yielded
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation, or an error thrown in by the task
                try:
                    value = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as done:
                    return done.value
