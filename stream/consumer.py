"""Where the worker's Kafka consumer differs from stock Faust, and why (both measured).

- A short fetch wait (``use_fetch_wait``): Tansu answers a waiting fetch only at its deadline.
- Delivery without four tasks per message (``Consumer.wait_first``): Faust's fetch loop hands
  each message to its topic's queue through ``wait_first(deliver, suspend_flow.wait())``,
  so that a rebalance (which sets ``suspend_flow``) can interrupt a delivery blocked on
  paused flow control. mode's ``wait_first`` wraps both awaitables and the service's
  stopped and crashed events in tasks and waits on all four: ~35-55 us a message on this
  machine, against ~0.2 us for a delivery that never blocks, which is nearly every one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

from faust.transport.drivers.aiokafka import Consumer as _FaustConsumer
from mode.services import WaitResults

__all__ = ["Consumer", "use_fetch_wait"]


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


class Consumer(_FaustConsumer):
    """Faust's aiokafka consumer whose ``wait_first`` runs its first awaitable inline."""

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
