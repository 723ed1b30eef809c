"""Progress of a long command when its output is not a terminal: a plain line every few
seconds while the stored count moves, the last state at the end, nothing when disabled;
the detail of ``probewire run``'s line from the worker's heartbeat."""

from __future__ import annotations

import io

from probewire.deploy.progress import StepProgress
from probewire.deploy.session import run_detail, stored_steps


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_every_few_seconds_while_the_count_moves_then_the_end():
    out, clock = io.StringIO(), Clock()
    with StepProgress("run demo-1", 40, out=out, every_s=5.0, clock=clock) as progress:
        for t, stored in ((0, 0), (2, 3), (5, 8), (7, 12), (10.5, 12), (16, 12), (20, 31)):
            clock.now = 100.0 + t
            progress.update(stored)
        clock.now = 121.0
        progress.update(40)
    assert out.getvalue().splitlines() == [
        "probewire: run demo-1: 8/40 steps stored, 5 s",  # 5 s in
        "probewire: run demo-1: 12/40 steps stored, 10 s",  # 10.5 s: moved since
        "probewire: run demo-1: 31/40 steps stored, 20 s",  # 16 s: unchanged, not repeated
        "probewire: run demo-1: 40/40 steps stored, 21 s",  # where it ended
    ]


def test_an_unknown_total_and_a_detail_and_a_disabled_progress():
    out, clock = io.StringIO(), Clock()
    with StepProgress("run own1", out=out, every_s=1.0, clock=clock) as progress:
        clock.now += 1
        progress.update(7, "running at step 7 · pages 0")
    assert (
        out.getvalue() == "probewire: run own1: 7 steps stored, 1 s · running at step 7 · pages 0\n"
    )
    quiet = io.StringIO()
    with StepProgress("run x", 5, out=quiet, every_s=0.0, enabled=False) as progress:
        progress.update(5)
    assert quiet.getvalue() == ""


def test_run_detail_and_stored_steps_read_the_heartbeat():
    beat = {
        "runs": {"a": {"steps_written": 12, "status": "running", "last_step": 11, "alerts": 2}},
        "healthy": False,
        "reasons": ["stage 2 stalled"],
    }
    assert stored_steps(beat, "a") == 12 and stored_steps(beat, "b") == 0
    assert (
        run_detail(beat, "a") == "running at step 11 · pages 2 · worker UNHEALTHY: stage 2 stalled"
    )
    assert run_detail({"runs": {}}, "b") == "waiting for its first step · pages 0"
    assert run_detail(None, "a") == "worker starting"
