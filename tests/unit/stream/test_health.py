"""Health means progress: the verdict from what the agents did (``stream.health``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from probewire.stream.health import HealthConfig, Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_running_agents_with_no_waiting_input_are_healthy():
    progress = Progress(HealthConfig(), Clock())
    progress.agent_started("per_run")
    assert progress.report()["healthy"] is True


def test_a_crashed_agent_stays_unhealthy_after_faust_restarts_it():
    progress = Progress(HealthConfig(), Clock())
    progress.agent_started("per_run")
    progress.agent_crashed("per_run", RuntimeError("boom"))
    assert progress.reasons() == ["agent per_run crashed: RuntimeError: boom"]
    progress.agent_started("per_run")  # Faust's supervisor restarted the actor
    [reason] = progress.reasons()
    assert reason.startswith("agent per_run crashed: RuntimeError: boom (restarted")


def test_input_waiting_past_stall_s_without_output_is_unhealthy_with_the_last_error():
    clock = Clock()
    progress = Progress(HealthConfig(stall_s=10.0), clock)
    progress.waiting("stage2", 3, clock.now)
    progress.failed("stage2", "store down")
    clock.now += 9.0
    assert progress.reasons() == []
    clock.now += 1.0
    assert progress.reasons() == [
        "stage2: 3 input(s) waiting, no output for 10s (last error: store down)"
    ]
    progress.output("stage2", 3)
    progress.waiting("stage2", 0, None)
    assert progress.reasons() == []


def test_a_dead_letter_spike_within_the_window_is_unhealthy_and_ages_out():
    clock = Clock()
    progress = Progress(HealthConfig(deadletter_spike=5, window_s=60.0), clock)
    progress.dead_letter(4)
    assert progress.reasons() == []
    progress.dead_letter()
    assert progress.reasons() == ["5 dead letters in the last 60s (spike threshold 5)"]
    clock.now += 61.0
    assert progress.reasons() == []


def test_a_broker_unanswered_for_broker_s_makes_the_worker_unhealthy_and_an_answer_clears_it():
    now = [100.0]
    progress = Progress(HealthConfig(broker_s=5.0), clock=lambda: now[0])
    progress.broker("")
    now[0] = 101.0
    progress.broker("Local: Broker transport failure")
    now[0] = 104.0
    assert progress.reasons() == []  # 4 s without an answer: within broker_s
    now[0] = 106.0
    assert progress.reasons() == ["broker unreachable for 6s (Local: Broker transport failure)"]
    progress.broker("")
    assert progress.reasons() == []


def test_writer_alive_tells_a_running_process_from_a_gone_or_zombie_one():
    import subprocess
    import sys

    from probewire.instrument.plumbing import writer_alive

    assert writer_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not writer_alive(child.pid)  # exited, not yet reaped: a zombie
    child.wait()
    assert not writer_alive(child.pid)
