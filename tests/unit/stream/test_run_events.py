"""Run lifecycle events into the ``runs`` row, and the learning rates of the P0 view."""

from __future__ import annotations

import json

import pytest

from probewire.instrument.catalog import Label, Optim
from probewire.instrument.lifecycle import run_event
from probewire.instrument.wire import RankIdentity, RankStep, series_key
from probewire.stream.lifecycle import EventError, RunLifecycle, parse_event
from probewire.stream.reduce import reduce_step
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


def attempt_event(kind: str, at: int, attempt: str, rank: int = 0, **kw):
    ident = RankIdentity(run_id="run", rank=rank, world_size=2)
    return parse_event(run_event(ident, kind, now_ns=at, attempt=attempt, **kw))


HOUR_NS = 3600 * 10**9


@pytest.mark.parametrize("crash_first", [False, True])
def test_a_crash_from_a_rank_whose_clock_is_an_hour_behind_ends_the_attempt_crashed(crash_first):
    """Clocks order nothing within an attempt: rank 1's crash stamped an hour before rank 0's
    start still crashes the run, before or after rank 0's finish."""
    life = RunLifecycle()
    t = 10 * HOUR_NS
    crash = attempt_event("crashed", t - HOUR_NS, "job:0", rank=1, error="OOM")
    finish = attempt_event("finished", t + 5, "job:0")
    life.apply(attempt_event("started", t, "job:0", config={"lr": 1}))
    for e in (crash, finish) if crash_first else (finish, crash):
        life.apply(e)
    assert life.status(idle_finished=False) == "crashed" and life.error == "OOM"
    assert life.config == {"lr": 1}


def test_a_new_attempt_resumes_and_a_late_event_of_the_earlier_attempt_changes_nothing():
    life = RunLifecycle()
    life.apply(attempt_event("started", 50, "job:0", config={"a": 0}))
    life.apply(attempt_event("crashed", 60, "job:0", rank=1))
    resumed = attempt_event("started", 1, "job:1", config={"a": 1})  # its clock is behind
    assert life.apply(resumed)
    assert life.status(idle_finished=False) == "running" and life.config == {"a": 1}
    assert not life.apply(attempt_event("crashed", 99, "job:0", rank=1))  # late, earlier
    assert not life.apply(attempt_event("started", 99, "job:0", config={"a": 0}))
    assert not life.apply(resumed)  # re-delivered
    assert life.status(idle_finished=False) == "running" and life.config == {"a": 1}
    again = RunLifecycle.from_state(json.loads(json.dumps(life.to_state())))
    assert again.to_state() == life.to_state()
    assert not again.apply(attempt_event("crashed", 99, "job:0", rank=1))


def test_an_attempt_comes_from_the_launchers_environment():
    from probewire.instrument.lifecycle import attempt_id

    assert attempt_id({}) == "" and attempt_id({"TORCHELASTIC_RUN_ID": "none"}) == ""
    assert attempt_id({"PROBEWIRE_ATTEMPT": "p", "TORCHELASTIC_RUN_ID": "j"}) == "p:0"
    torchrun = {"TORCHELASTIC_RUN_ID": "j", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert attempt_id(torchrun) == "torchrun:j:2"
    assert attempt_id({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}) == "slurm:77:1"


@pytest.mark.parametrize(
    "field, value", [("attempt", 3), ("attempt", "x" * 201), ("step", -2), ("seq", True)]
)
def test_a_bad_ordering_field_is_refused(field, value):
    body = {"run_id": "r", "event": "started", "rank": 0, "time_unix_nano": 1, field: value}
    with pytest.raises(EventError, match=field):
        parse_event(json.dumps(body).encode())


def test_a_note_event_sets_the_note_and_tags_and_nothing_else():
    """The UI's note (``note_event``): the newest by its time wins, whatever the attempt;
    status and config stay; re-delivery or an older note changes nothing; the state keeps
    it; a bad note is refused with its reason."""
    from probewire.instrument.lifecycle import note_event

    run = RunPipeline("run", Stage2Config())
    run.on_event(event("started", 10, config={"lr": 0.1}, attempt="a1"))
    run.on_event(event("finished", 20, attempt="a1"))
    note = parse_event(note_event("run", "lr too high?", ["sweep", "bad", "sweep"], now_ns=5))
    [row] = run.on_event(note).rows["runs"]
    assert (row["note"], row["tags"]) == ("lr too high?", ["sweep", "bad"])
    assert (row["status"], json.loads(row["config"])) == ("finished", {"lr": 0.1})
    assert run.on_event(note).rows == {}  # re-delivery
    assert run.on_event(parse_event(note_event("run", "older", [], now_ns=4))).rows == {}
    [row] = run.on_event(parse_event(note_event("run", "", ["kept"], now_ns=6))).rows["runs"]
    assert (row["note"], row["tags"]) == ("", ["kept"])
    resumed = RunPipeline.from_state("run", Stage2Config(), run.to_state(), 0.0)
    [row] = resumed.on_event(event("crashed", 30, attempt="a2")).rows["runs"]
    assert (row["note"], row["tags"], row["status"]) == ("", ["kept"], "crashed")
    for bad, reason in (
        (note_event("run", "x" * 2001, []), "note must be text"),
        (note_event("run", "", ["t" * 65]), "tags must be a list"),
        (note_event("run", "", [""]), "tags must be a list"),
    ):
        with pytest.raises(EventError, match=reason):
            parse_event(bad)


def test_a_note_alone_does_not_announce_the_run():
    from probewire.instrument.lifecycle import note_event

    life = RunLifecycle()
    assert life.apply(parse_event(note_event("run", "n", ["t"], now_ns=1)))
    assert not life.announced and life.status(idle_finished=False) == "running"
    # a run the worker never heard of (written outside the stream): no runs row that would
    # blank the stored one; the note is kept for when the run is heard
    run = RunPipeline("run", Stage2Config())
    assert run.on_event(parse_event(note_event("run", "n", ["t"], now_ns=1))).rows == {}
    [row] = run.on_event(event("started", 10, config={"lr": 0.1})).rows["runs"]
    assert (row["note"], row["tags"]) == ("n", ["t"])
