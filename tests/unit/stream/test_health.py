"""Health means progress: the verdict from what the agents did (``stream.health``)."""

from __future__ import annotations

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
