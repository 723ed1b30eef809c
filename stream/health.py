"""Health means progress: what the worker's agents did, written to a heartbeat file.

A worker is healthy when every agent runs, its input does not wait without output, dead
letters do not spike, and the broker answered within ``broker_s``. ``Progress`` is told by
the agents what they take in and put out; the heartbeat file carries its verdict and the
reasons, and ``probewire health`` exits non-zero on an unhealthy verdict, on a file older
than its ``--max-age-s`` (10 s: the worker's event loop rewrites it every second, so a
frozen or stopped worker fails within that) or when the process that wrote it is gone (a
killed worker fails at once: ``writer_alive``). The file carries what the agents did,
not that a timer ran.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from probewire.instrument.plumbing import check

__all__ = ["HealthConfig", "Progress"]


@dataclass(kw_only=True, slots=True)
class HealthConfig:
    """When the worker stops being healthy (``stream.health``)."""

    stall_s: float = 120.0  # input waiting this long with no output
    deadletter_spike: int = 1000  # dead letters within window_s
    window_s: float = 60.0
    broker_s: float = 5.0  # the broker unanswered this long: not ready

    def __post_init__(self) -> None:
        for name in ("stall_s", "window_s", "broker_s"):
            check(getattr(self, name) > 0, name, "must be > 0")
        check(self.deadletter_spike >= 1, "deadletter_spike", "must be >= 1")


@dataclass(slots=True)
class _Stage:
    waiting: int = 0
    waiting_since: float | None = None  # arrival of the oldest input without output
    last_output: float | None = None
    outputs: int = 0
    error: str = ""  # the last failure (a store or broker error)


class Progress:
    """The agents' progress and the verdict on it. Call from the event loop only."""

    def __init__(self, config: HealthConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.agents: dict[str, str] = {}  # name -> "running" | "crashed: ..." | "stopped"
        self.crashes: dict[str, str] = {}  # name -> the first crash (kept: see agent_crashed)
        self.stages: dict[str, _Stage] = {}
        self._dead_letters: deque[float] = deque()
        self.dead_letters = 0
        self.broker_ok_at = clock()  # the broker's last answer (start: its preflight)
        self.broker_error = ""  # why the last probe of it failed; "" when it answered

    # -- what the agents report -------------------------------------------------------------
    def agent_started(self, name: str) -> None:
        self.agents[name] = "running"

    def agent_crashed(self, name: str, error: BaseException) -> None:
        """Faust restarts a crashed agent, but the event it crashed on is neither processed
        nor acknowledged, so its partition commits no further until the worker restarts:
        the worker stays unhealthy (its orchestrator restarts it, the input is re-read)."""
        self.agents[name] = f"crashed: {type(error).__name__}: {error}"
        self.crashes.setdefault(name, self.agents[name])

    def agent_stopped(self, name: str) -> None:
        self.agents[name] = "stopped"

    def waiting(self, stage: str, count: int, since: float | None) -> None:
        """``count`` inputs of ``stage`` wait for their output, the oldest since ``since``."""
        s = self.stages.setdefault(stage, _Stage())
        s.waiting, s.waiting_since = count, since if count else None

    def output(self, stage: str, n: int = 1) -> None:
        s = self.stages.setdefault(stage, _Stage())
        s.last_output, s.outputs, s.error = self.clock(), s.outputs + n, ""

    def failed(self, stage: str, error: str) -> None:
        self.stages.setdefault(stage, _Stage()).error = error

    def broker(self, error: str) -> None:
        """The result of one probe of the broker: "" when it answered, else why not."""
        self.broker_error = error
        if not error:
            self.broker_ok_at = self.clock()

    def dead_letter(self, n: int = 1) -> None:
        now = self.clock()
        self.dead_letters += n
        self._dead_letters.extend([now] * n)

    # -- the verdict --------------------------------------------------------------------------
    def reasons(self) -> list[str]:
        now, cfg = self.clock(), self.config
        out = [
            f"agent {name} {state}"
            + (
                ""
                if self.agents.get(name, "") == state
                else " (restarted; its input is held: restart the worker)"
            )
            for name, state in sorted(self.crashes.items())
        ]
        for name, s in sorted(self.stages.items()):
            if not s.waiting or s.waiting_since is None:
                continue
            progress = max(s.waiting_since, s.last_output or s.waiting_since)
            if now - progress >= cfg.stall_s:
                error = f" (last error: {s.error})" if s.error else ""
                out.append(
                    f"{name}: {s.waiting} input(s) waiting, no output for "
                    f"{now - progress:.0f}s{error}"
                )
        if self.broker_error and now - self.broker_ok_at >= cfg.broker_s:
            out.append(
                f"broker unreachable for {now - self.broker_ok_at:.0f}s ({self.broker_error})"
            )
        while self._dead_letters and now - self._dead_letters[0] > cfg.window_s:
            self._dead_letters.popleft()
        if len(self._dead_letters) >= cfg.deadletter_spike:
            out.append(
                f"{len(self._dead_letters)} dead letters in the last "
                f"{cfg.window_s:.0f}s (spike threshold {cfg.deadletter_spike})"
            )
        return out

    def report(self) -> dict[str, Any]:
        """The heartbeat's health fields: verdict, reasons, agents, stages."""
        reasons = self.reasons()
        now = self.clock()
        return {
            "healthy": not reasons,
            "reasons": reasons,
            "agents": dict(self.agents),
            "dead_letters": self.dead_letters,
            "stages": {
                name: {
                    "waiting": s.waiting,
                    "outputs": s.outputs,
                    "output_age_s": None
                    if s.last_output is None
                    else round(now - s.last_output, 1),
                    "error": s.error,
                }
                for name, s in self.stages.items()
            },
        }
