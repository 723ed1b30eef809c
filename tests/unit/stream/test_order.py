"""Stage 2 step ordering: in order, gaps skipped by time, state survives a restart."""

from __future__ import annotations

import base64

from probewire.instrument.wire import RankStep, series_key
from probewire.stream.order import StepOrderer
from probewire.stream.records import ReducedStep
from probewire.stream.reduce import reduce_step


def item(step: int):
    rec = RankStep(
        run_id="r",
        step=step,
        rank=0,
        world_size=1,
        host="h",
        coords={"dp": 0},
        values={series_key("loss.tokens"): 1.0},
    )
    return reduce_step("r", step, 1, [rec], "all_ranks")


def test_out_of_order_steps_are_released_in_order():
    orderer = StepOrderer(max_wait_s=10)
    assert orderer.offer(item(1), now=0) == []
    assert [i.step for i in orderer.offer(item(0), now=0)] == [0, 1]
    assert [i.step for i in orderer.offer(item(2), now=0)] == [2]


def test_gap_is_skipped_after_max_wait_and_old_step_passes_through():
    orderer = StepOrderer(max_wait_s=10)
    orderer.offer(item(0), now=0)
    assert orderer.offer(item(2), now=1) == []
    assert orderer.expire(now=10.9) == []
    assert [i.step for i in orderer.expire(now=11)] == [2]
    assert [i.step for i in orderer.offer(item(1), now=12)] == [1]


def test_resumed_run_starts_at_its_first_step_after_max_wait():
    orderer = StepOrderer(max_wait_s=5)
    assert orderer.offer(item(101), now=0) == []
    assert orderer.offer(item(100), now=1) == []
    assert [i.step for i in orderer.expire(now=5)] == [100, 101]


def test_state_round_trip_keeps_held_steps():
    orderer = StepOrderer(max_wait_s=5)
    orderer.offer(item(0), now=0)
    orderer.offer(item(2), now=0)
    back = StepOrderer.from_state(orderer.to_state(), max_wait_s=5, now=100)
    assert back.next_step == 1 and list(back.held) == [2]
    assert [i.step for i in back.offer(item(1), now=100)] == [1, 2]


def test_the_saved_state_encodes_each_held_step_once(monkeypatch):
    """A run catching up holds many steps and its state is saved with every store batch:
    each held step is encoded once, and the state is what encoding them afresh gives, in
    the held order, after releases and gap skips."""
    encoded = []
    to_bytes = ReducedStep.to_bytes
    monkeypatch.setattr(
        ReducedStep, "to_bytes", lambda self: encoded.append(self.step) or to_bytes(self)
    )
    orderer = StepOrderer(max_wait_s=5)
    for step, now in ((3, 0), (5, 0), (4, 0), (9, 3)):
        orderer.offer(item(step), now=now)
    fresh = lambda: [base64.b64encode(to_bytes(i)).decode() for _, i in orderer.held.values()]
    assert orderer.to_state()["held"] == fresh()
    assert orderer.to_state()["held"] == fresh()
    assert sorted(encoded) == [3, 4, 5, 9]
    orderer.expire(now=5)  # 3, 4, 5 released (the gap before 3 skipped); 9 waits
    orderer.offer(item(7), now=6)
    assert orderer.to_state() == {"next_step": 6, "held": fresh()}
    assert sorted(encoded) == [3, 4, 5, 7, 9]
    assert orderer._saved.keys() == orderer.held.keys()  # released steps are let go
    back = StepOrderer.from_state(orderer.to_state(), max_wait_s=5, now=10)
    assert [i.step for i in back.offer(item(6), now=10)] == [6, 7]
    assert [i.step for i in back.offer(item(8), now=10)] == [8, 9]
