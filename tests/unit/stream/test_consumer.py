"""The worker's consumer delivers each message as mode's ``wait_first`` would (``consumer``):
a delivery that never suspends wins without tasks, one that blocks still yields to a
rebalance's ``suspend_flow``, and errors and results come back the same way. Run on the
consumer Faust builds for the worker's app, in the test's event loop (a mode service keeps
the loop it was made in); nothing connects: the broker is never reached."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from probewire.stream.app import _App
from probewire.stream.consumer import Consumer


@pytest.fixture
def new_consumer(tmp_path):
    def make() -> Consumer:
        app = _App(
            "probewire-test-consumer",
            broker="kafka://127.0.0.1:9",
            web_enabled=False,
            datadir=str(tmp_path / "faust"),
        )
        assert isinstance(app.consumer, Consumer)
        return app.consumer

    return make


def _closed(coro) -> bool:
    return inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


def test_a_delivery_that_never_suspends_wins_with_no_task_and_the_others_are_closed(new_consumer):
    async def main():
        delivered = []

        async def deliver(message):
            delivered.append(message)
            return "put"

        suspend = asyncio.Event()
        waiting = suspend.wait()
        before = len(asyncio.all_tasks())
        result = await new_consumer().wait_first(deliver(7), waiting)
        assert len(asyncio.all_tasks()) == before
        return delivered, result, waiting

    delivered, result, waiting = asyncio.run(main())
    assert delivered == [7]
    assert result.results == ["put"] and result.stopped is False
    assert _closed(waiting)


def test_a_blocked_delivery_is_interrupted_by_suspend_flow_as_with_mode(new_consumer):
    async def main():
        resume, suspend = asyncio.Event(), asyncio.Event()
        seen = []

        async def deliver():
            seen.append("started")
            try:
                await resume.wait()  # flow control paused by a rebalance
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            seen.append("delivered")

        asyncio.get_running_loop().call_later(0.01, suspend.set)
        result = await new_consumer().wait_first(deliver(), suspend.wait())
        await asyncio.sleep(0)  # the cancelled delivery's task runs its cancellation
        return seen, result

    seen, result = asyncio.run(main())
    assert seen == ["started", "cancelled"]
    assert result.results == [True] and result.stopped is False


def test_a_blocked_delivery_that_resumes_returns_its_value(new_consumer):
    async def main():
        resume = asyncio.Event()

        async def deliver():
            await resume.wait()
            await asyncio.sleep(0)
            return "late put"

        asyncio.get_running_loop().call_later(0.01, resume.set)
        return await new_consumer().wait_first(deliver(), asyncio.Event().wait())

    assert asyncio.run(main()).results == ["late put"]


@pytest.mark.parametrize("suspends", [False, True])
def test_an_error_in_delivery_propagates_and_leaves_nothing_unawaited(new_consumer, suspends):
    async def main():
        async def deliver():
            if suspends:
                await asyncio.sleep(0)
            raise ValueError("undecodable")

        waiting = asyncio.Event().wait()
        with pytest.raises(ValueError, match="undecodable"):
            await new_consumer().wait_first(deliver(), waiting)
        await asyncio.sleep(0)
        return waiting

    assert _closed(asyncio.run(main()))
