"""Stage 2's store batch: when a write is due, what it acknowledges, and a failed write."""

from __future__ import annotations

import pytest

from probewire.instrument.plumbing import ConfigError
from probewire.stream.batching import BatchConfig, StoreBatch
from probewire.stream.stage2 import Stage2Output


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def out(step: int) -> Stage2Output:
    o = Stage2Output()
    o.rows["step_metrics"].append({"step": step})
    return o


def states(run_id: str) -> tuple[int, dict]:
    return 0, {"run": run_id}


def test_due_when_full_or_old_and_acks_only_after_written():
    clock = Clock()
    batch = StoreBatch(BatchConfig(steps=3, within_s=1.0), clock)
    batch.add("a", out(0), "m0")
    batch.add("a", out(1), "m1")
    assert not batch.due()
    batch.add("b", out(0), "m2")
    assert batch.due()
    taken = batch.take(states)
    assert batch.take(states) is None and not batch.due()  # one write in flight
    assert taken.states == {"a": (0, {"run": "a"}), "b": (0, {"run": "b"})}
    assert batch.waiting == 3
    assert batch.written(taken) == ["m0", "m1", "m2"] and batch.waiting == 0
    batch.add("a", out(2), "m3")
    assert not batch.due()
    clock.now = 1.0
    assert batch.due()


def test_a_run_whose_step_was_only_held_still_has_its_state_saved():
    batch = StoreBatch(BatchConfig(steps=1), Clock())
    batch.add("a", Stage2Output(), "m0")  # no rows: the orderer held the step
    assert batch.take(states).states == {"a": (0, {"run": "a"})}


def test_a_failed_write_goes_back_whole_before_what_came_after_and_waits():
    clock = Clock()
    batch = StoreBatch(BatchConfig(steps=1, retry_max_s=0.4), clock)
    batch.add("a", out(0), "m0")
    first = batch.take(states)
    batch.add("a", out(1), "m1")  # arrives while the write is in flight
    assert batch.failed(first, "store down") == pytest.approx(0.1)
    assert not batch.due()  # retry pause
    clock.now = 0.1
    retry = batch.take(states)
    assert [r["step"] for r in retry.outputs["a"].rows["step_metrics"]] == [0, 1]
    assert retry.acks == ["m0", "m1"] and batch.last_error == "store down"
    delays = [batch.failed(retry, "again")]
    for _ in range(4):
        clock.now += 1
        delays.append(batch.failed(batch.take(states), "again"))
    assert delays == pytest.approx([0.2, 0.4, 0.4, 0.4, 0.4])  # capped
    clock.now += 1
    assert batch.written(batch.take(states)) == ["m0", "m1"] and batch.failures == 0


def test_full_backlog_stops_input():
    batch = StoreBatch(BatchConfig(steps=2, max_backlog_steps=3), Clock())
    for i in range(3):
        batch.add("a", out(i), f"m{i}")
    assert batch.full


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"steps": 0}, "steps"),
        ({"within_s": 0}, "within_s"),
        ({"steps": 10, "max_backlog_steps": 5}, "max_backlog_steps"),
    ],
)
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=f"^{field}:"):
        BatchConfig(**kw)
