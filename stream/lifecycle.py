"""What a run says about itself (``probewire.runs``): its configuration, its end, its crash.

The ranks send JSON events (``instrument.lifecycle``): ``started`` (rank 0, with the run's
configuration), ``finished`` (rank 0, ``Monitor.close``) and ``crashed`` (any rank). This
module checks them (``parse_event``) and folds them into the run's status
(``RunLifecycle``), which stage 2 writes into every ``runs`` row of the run:

- the status is ``running`` until an end event; a crash wins over a finish of the same
  attempt (rank 0 may close cleanly while rank 1 died);
- a ``started`` event newer than the end starts a new attempt (a resumed run): running
  again, with its configuration;
- events older than the current attempt's start are ignored, so re-delivery and the
  order of topics cannot undo a newer state.

Pure: no Kafka, no store. The state serialises with the run's stage-2 state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from probewire.instrument.wire import DecodeError

__all__ = ["EventError", "RunEvent", "RunLifecycle", "parse_event"]

EVENTS = ("started", "finished", "crashed")
MAX_EVENT_BYTES = 128 * 1024


class EventError(DecodeError):
    """Bytes that are not a run event; ``reason`` goes to the dead letter."""


@dataclass(frozen=True, slots=True)
class RunEvent:
    run_id: str
    event: str
    rank: int
    time_unix_nano: int
    config: dict[str, Any] | None = None
    error: str = ""


def parse_event(payload: bytes | None) -> RunEvent:
    """One event, checked field by field; an ``EventError`` with the reason otherwise."""
    if not payload or len(payload) > MAX_EVENT_BYTES:
        raise EventError(f"run event of {len(payload or b'')} bytes (limit {MAX_EVENT_BYTES})")
    try:
        body = json.loads(payload)
    except ValueError as exc:
        raise EventError(f"run event is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise EventError("run event is not a JSON object")
    run_id, event, rank, at = (body.get(k) for k in ("run_id", "event", "rank", "time_unix_nano"))
    if not isinstance(run_id, str) or not run_id or ":" in run_id:
        raise EventError(f"run event: bad run_id {run_id!r}")
    if event not in EVENTS:
        raise EventError(f"run event: event must be one of {EVENTS}, got {event!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise EventError(f"run event: bad rank {rank!r}")
    if not isinstance(at, int) or isinstance(at, bool) or at < 0:
        raise EventError(f"run event: bad time_unix_nano {at!r}")
    config = body.get("config")
    if config is not None and not isinstance(config, dict):
        raise EventError("run event: config must be an object")
    error = body.get("error", "")
    return RunEvent(
        run_id=run_id,
        event=event,
        rank=rank,
        time_unix_nano=at,
        config=config,
        error=str(error)[:1000],
    )


class RunLifecycle:
    """The run's status and configuration from its events (see the module docstring)."""

    def __init__(self) -> None:
        self.started_ns = -1
        self.config: dict[str, Any] = {}
        self.ended: str | None = None  # "finished" or "crashed" for the current attempt
        self.ended_ns = -1
        self.error = ""

    def apply(self, event: RunEvent) -> bool:
        """Fold one event in; whether it changed anything."""
        at = event.time_unix_nano
        if event.event == "started":
            if at < self.started_ns:
                return False
            self.started_ns = at
            self.config = dict(event.config or {})
            if self.ended is not None and self.ended_ns < at:
                self.ended, self.ended_ns, self.error = None, -1, ""
            return True
        if at < self.started_ns or self.ended == "crashed":
            return False
        if self.ended == event.event:
            return False
        self.ended, self.ended_ns, self.error = event.event, at, event.error
        return True

    def status(self, idle_finished: bool) -> str:
        """``crashed`` or ``finished`` as the run said; else ``finished`` when stage 2 ended
        it for idleness; else ``running``."""
        return self.ended or ("finished" if idle_finished else "running")

    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True, allow_nan=False, default=str)

    def to_state(self) -> dict[str, Any]:
        return {
            "started_ns": self.started_ns,
            "config": self.config,
            "ended": self.ended,
            "ended_ns": self.ended_ns,
            "error": self.error,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> RunLifecycle:
        run = cls()
        if state:
            run.started_ns, run.config = int(state["started_ns"]), dict(state["config"])
            run.ended, run.ended_ns = state["ended"], int(state["ended_ns"])
            run.error = str(state.get("error", ""))
        return run
