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


def _message(offset: int):
    from faust.types import TP, Message

    return Message("t", 0, offset, 0.0, 0, {}, b"k", b"v", None, tp=TP("t", 0))


def test_a_commit_never_passes_the_unacknowledged_message_at_the_committed_offset(new_consumer):
    """The message at the committed offset (a pending step's first rank message) is not
    acknowledged while later ones are: nothing is committed (Faust committed 18, and the
    partition's next reader never saw offset 10); once it is, the run through 17 is."""
    from faust.types import TP

    consumer, tp = new_consumer(), TP("t", 0)
    consumer._committed_offset[tp] = 10
    consumer._acked[tp] = list(range(11, 18))
    consumer._acked_index[tp] = set(range(11, 18))
    assert consumer._new_offset(tp) is None
    consumer._acked[tp].append(10)
    consumer._acked_index[tp].add(10)
    assert consumer._new_offset(tp) == 18 and consumer._acked[tp] == []


def test_with_no_committed_offset_a_commit_starts_at_the_first_offset_read(new_consumer):
    """A new group (no committed offset, or 0, which Faust keeps as None): offsets 1-2 are
    acknowledged, offset 0 (the first read) is not: nothing is committed, then 3."""
    from faust.types import TP

    consumer, tp = new_consumer(), TP("t", 0)
    for offset in range(3):
        consumer.track_message(_message(offset))
    consumer._acked[tp] = [1, 2]
    consumer._acked_index[tp] = {1, 2}
    assert consumer._new_offset(tp) is None
    consumer._acked[tp].append(0)
    assert consumer._new_offset(tp) == 3


@pytest.mark.parametrize(
    "acked, start, n",
    [([], 0, 0), ([3, 4], None, 0), ([4, 5], 3, 0), ([3, 4, 6], 3, 2), ([1, 2, 3], 3, 3)],
)
def test_committable_is_the_run_of_consecutive_offsets_from_the_start(acked, start, n):
    from probewire.stream.consumer import committable

    assert committable(acked, start) == n
