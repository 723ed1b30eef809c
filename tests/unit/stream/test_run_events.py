"""Run lifecycle events into the ``runs`` row, and the learning rates of the P0 view."""

from __future__ import annotations

import json

import pytest

from probewire.instrument.catalog import Label, Optim
from probewire.instrument.lifecycle import run_event
from probewire.instrument.wire import RankIdentity, RankStep, series_key
from probewire.stream.assemble import reduce_step
from probewire.stream.lifecycle import EventError, RunLifecycle, parse_event
from probewire.stream.stage2 import RunPipeline, Stage2Config, p0_view


def event(kind: str, at: int, rank: int = 0, **kw):
    ident = RankIdentity(run_id="run", rank=rank, world_size=2)
    return parse_event(run_event(ident, kind, now_ns=at, **kw))


def step(n: int, lrs: dict[str, float] | None = None):
    ranks = []
    for r in range(2):
        values = {
            series_key("loss.sum"): 6.0,
            series_key("loss.tokens"): 3.0,
            series_key("step.duration"): 0.1,
        }
        for group, lr in (lrs or {}).items():
            values[series_key(Optim.LR, {Label.PARAM_GROUP: group})] = lr
        ranks.append(
            RankStep(
                run_id="run",
                step=n,
                rank=r,
                world_size=2,
                host="h",
                coords={"dp": r},
                values=values,
            )
        )
    return reduce_step("run", n, 2, ranks, "all_ranks")


def test_started_config_then_finished_is_stored_and_survives_later_steps():
    run = RunPipeline("run", Stage2Config())
    [row] = run.on_event(event("started", 10, config={"lr": 0.1})).rows["runs"]
    assert row["status"] == "running" and json.loads(row["config"]) == {"lr": 0.1}
    run.accept(step(0), 0.0)
    [row] = run.on_event(event("finished", 20)).rows["runs"]
    assert row["status"] == "finished"
    # the last steps reach stage 2 after the finish event: the run stays finished
    [row] = run.accept(step(1), 0.1).rows["runs"]
    assert row["status"] == "finished" and row["last_step"] == 1
    assert json.loads(row["config"]) == {"lr": 0.1}
    assert run.on_event(event("finished", 21)).rows == {}  # re-delivery changes nothing


def test_a_crash_wins_over_a_finish_and_a_newer_start_resumes():
    life = RunLifecycle()
    life.apply(event("started", 10))
    life.apply(event("crashed", 30, rank=1, error="RuntimeError: x"))
    assert not life.apply(event("finished", 40))
    assert life.status(idle_finished=False) == "crashed" and life.error == "RuntimeError: x"
    assert not life.apply(event("started", 5))  # older than the current attempt
    life.apply(event("started", 50, config={"resumed": True}))
    assert life.status(idle_finished=False) == "running" and life.config == {"resumed": True}
    assert life.status(idle_finished=True) == "finished"
    again = RunLifecycle.from_state(json.loads(json.dumps(life.to_state())))
    assert again.to_state() == life.to_state()


@pytest.mark.parametrize(
    "payload, reason",
    [
        (b"", "bytes"),
        (b"[1]", "object"),
        (b'{"run_id": "a:b"}', "run_id"),
        (b'{"run_id": "r", "event": "paused"}', "event must be"),
        (b'{"run_id": "r", "event": "started", "rank": -1, "time_unix_nano": 1}', "rank"),
    ],
)
def test_a_malformed_event_is_refused_with_its_reason(payload, reason):
    with pytest.raises(EventError, match=reason):
        parse_event(payload)


def test_learning_rates_per_group_and_their_maximum():
    view, _, _ = p0_view(step(0, {"0": 1e-3, "head": 5e-3}))
    assert view["lr_groups"] == {"0": 1e-3, "head": 5e-3} and view["lr"] == 5e-3
    view, _, _ = p0_view(step(0))
    assert view["lr"] is None and view["lr_groups"] == {}
