"""The final steps' detail is kept when the run says it ended (issue 37), not only after
``run_idle_s`` of silence: a 260-step run that says ``finished`` (or ``crashed``) has its
last 100 steps promoted into the detail tables at once, each step once; steps that arrive
after the event (its ranks named a later last step) are kept as they come."""

from __future__ import annotations

import pytest

from probewire.instrument.lifecycle import run_event
from probewire.instrument.wire import RankIdentity, RankStep, series_key
from probewire.stream.lifecycle import parse_event
from probewire.stream.reduce import reduce_step
from probewire.stream.stage2 import RunPipeline, Stage2Config


def step(n: int):
    ranks = [
        RankStep(
            run_id="end",
            step=n,
            rank=r,
            world_size=2,
            host="h",
            coords={"dp": r},
            values={series_key("loss.sum"): 6.0, series_key("loss.tokens"): 3.0},
        )
        for r in (0, 1)
    ]
    return reduce_step("end", n, 2, ranks, "all_ranks")


def event(kind: str, last_step: int):
    ident = RankIdentity(run_id="end", rank=0, world_size=2)
    return parse_event(run_event(ident, kind, now_ns=1, attempt="a1", step=last_step))


def promoted(run: RunPipeline, steps: range) -> list[int]:
    out = []
    for n in steps:
        out += run.accept(step(n), now=float(n)).promote
    return out


@pytest.mark.parametrize("kind", ["finished", "crashed"])
def test_the_last_100_steps_are_kept_when_the_run_says_it_ended(kind):
    run = RunPipeline("end", Stage2Config(run_idle_s=600, max_wait_s=5))
    run.on_event(event("started", -1))
    during = promoted(run, range(260))
    assert set(during) == {*range(100), 100, 200}  # warm-up and every 100th step
    at_end = run.on_event(event(kind, 259)).promote
    assert sorted(at_end) == [s for s in range(160, 260) if s != 200]
    assert run.on_event(event(kind, 259)).promote == []  # idempotent: each step once
    assert run.expire(now=10_000.0).promote == []  # the silence later keeps nothing again


def test_steps_after_an_early_finished_event_are_kept_as_they_arrive():
    """The ranks' ``finished`` can reach stage 2 before their last steps do: nothing is
    released until the step they named is in, then the final steps are kept at once."""
    run = RunPipeline("end", Stage2Config(run_idle_s=600, max_wait_s=5))
    run.on_event(event("started", -1))
    promoted(run, range(250))
    assert run.on_event(event("finished", 259)).promote == []  # 250..259 still to come
    late = promoted(run, range(250, 260))
    assert sorted(late) == [s for s in range(160, 260) if s != 200]


def test_an_event_that_names_no_step_leaves_the_release_to_the_silence():
    """Without the last step (an older rank), the event could come before the final steps:
    releasing then would keep the wrong ones. The silence releases them instead."""
    run = RunPipeline("end", Stage2Config(run_idle_s=600, max_wait_s=5))
    run.on_event(event("started", -1))
    promoted(run, range(255))
    assert run.on_event(event("finished", -1)).promote == []
    promoted(run, range(255, 260))
    assert sorted(run.expire(now=10_000.0).promote) == [s for s in range(160, 260) if s != 200]


@pytest.mark.parametrize("said", [-1, 259, 300])
def test_a_run_that_said_it_ended_keeps_its_final_steps_when_the_worker_stops(said):
    """The ranks said ``finished`` naming no step (an older rank), the last step, or a step
    that never came: the worker stops before the silence; at its shutdown the final steps
    are kept at once (each once: the release on the event and the shutdown share it)."""
    run = RunPipeline("end", Stage2Config(run_idle_s=600, max_wait_s=5))
    run.on_event(event("started", -1))
    promoted(run, range(260))
    at_event = run.on_event(event("finished", said)).promote
    at_stop = run.at_shutdown().promote
    assert sorted(at_event + at_stop) == [s for s in range(160, 260) if s != 200]
    assert run.at_shutdown().promote == []


def test_a_run_that_never_said_it_ended_keeps_nothing_more_at_shutdown():
    """No finished or crashed event: the run may go on (a checkpoint pause); its final
    steps wait for ``run_idle_s`` of silence, shutdown or not."""
    run = RunPipeline("end", Stage2Config(run_idle_s=600, max_wait_s=5))
    run.on_event(event("started", -1))
    promoted(run, range(260))
    assert run.at_shutdown().promote == []
    assert sorted(run.expire(now=10_000.0).promote) == [s for s in range(160, 260) if s != 200]
