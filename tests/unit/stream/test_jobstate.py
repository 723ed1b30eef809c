"""Run states that tell the truth in stage 2: a silent run that had not ended is ``stalled``
and pages ``job_state`` once per silence; a later step returns it to ``running``; a run
that said it finished or crashed keeps that status through the silence."""

from __future__ import annotations

import json

from probewire.instrument.lifecycle import run_event
from probewire.instrument.wire import RankIdentity, RankStep, series_key
from probewire.stream.jobstate import JOB_STATE, stall_alert
from probewire.stream.lifecycle import parse_event
from probewire.stream.reduce import reduce_step
from probewire.stream.stage2 import RunPipeline, Stage2Config


def step(n: int, ranks=(0, 1, 2), world_size: int = 3, reason: str = "all_ranks"):
    out = [
        RankStep(
            run_id="run",
            step=n,
            rank=r,
            world_size=world_size,
            host="h",
            coords={"dp": r},
            values={series_key("loss.sum"): 6.0, series_key("loss.tokens"): 3.0},
        )
        for r in ranks
    ]
    return reduce_step("run", n, world_size, out, reason)


def event(kind: str, attempt: str = "a1", rank: int = 0):
    ident = RankIdentity(run_id="run", rank=rank, world_size=3)
    return parse_event(run_event(ident, kind, now_ns=1, attempt=attempt))


def announced_run() -> RunPipeline:
    run = RunPipeline("run", Stage2Config(run_idle_s=30, max_wait_s=5))
    run.on_event(event("started"))
    return run


def test_a_silent_run_that_had_not_ended_is_stalled_and_pages_job_state_once():
    run = announced_run()
    for n in range(5):
        run.accept(step(n), now=n)
    run.accept(step(5, ranks=(0, 2), reason="deadline"), now=5.0)  # rank 1 died first
    assert run.expire(now=20.0).rows.get("alerts") is None  # 15 s: not yet silent
    out = run.expire(now=40.0)
    [page] = out.rows["alerts"]
    assert (page["signal"], page["step"], page["ranks"]) == (JOB_STATE, 5, [0, 2])
    assert "after step 5" in page["message"] and "rank(s) 0, 2" in page["message"]
    assert page["value"] == 35.0 and page["severity"] == "page"
    assert [r["status"] for r in out.rows["runs"]] == ["stalled"] and run.status() == "stalled"
    assert run.expire(now=100.0).rows == {}  # one page per silence
    again = RunPipeline.from_state("run", run.config, json.loads(json.dumps(run.to_state())), 0)
    assert again.status() == "stalled" and again.expire(now=1000.0).rows == {}


def test_a_step_after_a_stall_returns_the_run_to_running_and_a_new_silence_pages_again():
    run = announced_run()
    run.accept(step(0), now=0.0)
    run.expire(now=31.0)
    out = run.accept(step(1), now=100.0)  # a checkpoint save longer than the silence
    assert [r["step"] for r in out.rows["step_metrics"]] == [1]
    assert [r["status"] for r in out.rows["runs"]] == ["running"] and run.status() == "running"
    [page] = run.expire(now=131.0).rows["alerts"]
    assert page["step"] == 1 and page["ranks"] == [0, 1, 2]


def test_a_run_that_said_finished_or_crashed_keeps_its_status_through_the_silence():
    for end in ("finished", "crashed"):
        run = announced_run()
        run.accept(step(0), now=0.0)
        run.on_event(event(end))
        out = run.expire(now=31.0)
        assert out.rows.get("alerts") is None
        assert [r["status"] for r in out.rows["runs"]] == [end]


def test_a_run_with_no_lifecycle_events_is_finished_by_its_silence_with_no_page():
    run = RunPipeline("run", Stage2Config(run_idle_s=30))
    run.accept(step(0), now=0.0)
    out = run.expire(now=31.0)
    assert out.rows.get("alerts") is None and run.status() == "finished"


def test_the_stall_page_joins_consecutive_ranks():
    page = stall_alert("r", 7, [3, 0, 1, 2, 7], 301.0, 10)
    assert "rank(s) 0-3, 7 at that step" in page["message"] and page["ranks"] == [0, 1, 2, 3, 7]
    assert "for 301s after step 7" in page["message"]
