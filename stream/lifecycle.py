"""What a run says about itself (``probewire.runs``): its configuration, its end, its crash.

The ranks send JSON events (``instrument.lifecycle``): ``started`` (rank 0, with the run's
configuration), ``finished`` (rank 0, ``Monitor.close``) and ``crashed`` (any rank). This
module checks them (``parse_event``) and folds them into the run's status
(``RunLifecycle``), which stage 2 writes into every ``runs`` row of the run:

- the status is ``running`` until an end event; a crash wins over a finish of the same
  attempt (rank 0 may close cleanly while rank 1 died), in whichever order they come;
- events carry their attempt (``attempt``: the launch and restart the ranks share, from
  their launcher's environment), the rank's step and a per-process sequence number. The
  order comes from those, never from the ranks' clocks: an event of a new attempt starts
  it (a resumed or restarted run: running again), an event of an earlier attempt is
  ignored, and within an attempt the latest ``started`` by (step, sequence) gives the
  configuration. A rank whose clock is an hour behind still crashes its run;
- events without an attempt (a launcher that says nothing: one host, one clock) are
  ordered by their time as before: a ``started`` newer than the end starts a new attempt,
  events older than the current attempt's start are ignored;
- re-delivery of any event changes nothing.

A ``note`` event (``instrument.lifecycle.note_event``: the web UI's, never a rank's) sets
the run's note and tags (``runs.note``, ``runs.tags``) and nothing else: the newest by its
``time_unix_nano`` wins (one UI's clock), whatever the attempt.

Pure: no Kafka, no store. The state serialises with the run's stage-2 state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from probewire.instrument.wire import DecodeError

__all__ = ["EventError", "RunEvent", "RunLifecycle", "parse_event"]

EVENTS = ("started", "finished", "crashed", "note")
MAX_EVENT_BYTES = 128 * 1024
MAX_NOTE_CHARS = 2000
MAX_TAGS, MAX_TAG_CHARS = 32, 64
MAX_ATTEMPT_CHARS = 200
PAST_ATTEMPTS = 64  # earlier attempts remembered, so their late events are ignored


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
    attempt: str = ""  # the launch and restart the event belongs to; "" when unknown
    step: int = -1  # the rank's last step when it sent the event (-1: none yet)
    seq: int = 0  # the sending process's event counter
    note: str = ""  # a note event's note and tags
    tags: tuple[str, ...] = ()


def _optional_int(body: dict[str, Any], name: str, default: int, low: int) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise EventError(f"run event: bad {name} {value!r}")
    return value


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
    run_id, event, at = (body.get(k) for k in ("run_id", "event", "time_unix_nano"))
    rank = body.get("rank", 0 if event == "note" else None)  # a note is no rank's
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
    attempt = body.get("attempt", "")
    if not isinstance(attempt, str) or len(attempt) > MAX_ATTEMPT_CHARS:
        raise EventError(f"run event: attempt must be text of <= {MAX_ATTEMPT_CHARS} chars")
    return RunEvent(
        run_id=run_id,
        event=event,
        rank=rank,
        time_unix_nano=at,
        config=config,
        error=str(error)[:1000],
        attempt=attempt,
        step=_optional_int(body, "step", -1, -1),
        seq=_optional_int(body, "seq", 0, 0),
        **(_note(body) if event == "note" else {}),
    )


def _note(body: dict[str, Any]) -> dict[str, Any]:
    """A note event's note (text) and tags (distinct texts, in their order)."""
    note, tags = body.get("note", ""), body.get("tags", [])
    if not isinstance(note, str) or len(note) > MAX_NOTE_CHARS:
        raise EventError(f"run event: note must be text of <= {MAX_NOTE_CHARS} chars")
    if (
        not isinstance(tags, list)
        or len(tags) > MAX_TAGS
        or not all(isinstance(t, str) and 0 < len(t) <= MAX_TAG_CHARS for t in tags)
    ):
        raise EventError(
            f"run event: tags must be a list of <= {MAX_TAGS} texts of 1-{MAX_TAG_CHARS} chars"
        )
    return {"note": note, "tags": tuple(dict.fromkeys(tags))}


class RunLifecycle:
    """The run's status, configuration, note and tags from its events (module docstring)."""

    def __init__(self) -> None:
        self.started_ns = -1
        self.config: dict[str, Any] = {}
        self.ended: str | None = None  # "finished" or "crashed" for the current attempt
        self.ended_ns = -1
        self.error = ""
        self.attempt = ""  # the current attempt ("" : none named yet)
        self.past: list[str] = []  # earlier attempts, newest last (at most PAST_ATTEMPTS)
        self.config_order = (-2, -1)  # (step, seq) of the started event behind the config
        self.note = ""  # the UI's note and tags (a note event), and the event's time
        self.tags: tuple[str, ...] = ()
        self.note_ns = -1

    @property
    def announced(self) -> bool:
        """Whether the run said anything about itself (a ``started`` or an end)."""
        return self.started_ns >= 0 or self.ended is not None or bool(self.attempt)

    def apply(self, event: RunEvent) -> bool:
        """Fold one event in; whether it changed anything."""
        if event.event == "note":
            if event.time_unix_nano <= self.note_ns:
                return False
            self.note, self.tags = event.note, event.tags
            self.note_ns = event.time_unix_nano
            return True
        if event.attempt:
            return self._apply_attempt(event)
        at = event.time_unix_nano
        if event.event == "started":
            if at < self.started_ns:
                return False
            self.started_ns = at
            self.config = dict(event.config or {})
            if self.ended is not None and self.ended_ns < at:
                self.ended, self.ended_ns, self.error = None, -1, ""
            return True
        if at < self.started_ns:
            return False
        return self._end(event)

    def _apply_attempt(self, event: RunEvent) -> bool:
        """An event that names its attempt: ordered by attempt, then (step, seq)."""
        if event.attempt in self.past:
            return False  # an earlier attempt's event, late or re-delivered
        if event.attempt != self.attempt:  # the first word of a new attempt
            if self.attempt:
                self.past = [*self.past, self.attempt][-PAST_ATTEMPTS:]
            self.attempt = event.attempt
            self.ended, self.ended_ns, self.error = None, -1, ""
            self.config_order = (-2, -1)
        self.started_ns = max(self.started_ns, 0)
        if event.event == "started":
            order = (event.step, event.seq)
            if order <= self.config_order:
                return False
            self.config_order = order
            self.config = dict(event.config or {})
            return True
        return self._end(event)

    def _end(self, event: RunEvent) -> bool:
        """A finish or a crash of the current attempt: a crash wins, whatever came first."""
        if self.ended == "crashed" or self.ended == event.event:
            return False
        self.ended, self.ended_ns, self.error = event.event, event.time_unix_nano, event.error
        return True

    def status(self, idle_finished: bool, stalled: bool = False) -> str:
        """``crashed`` or ``finished`` as the run said; else ``stalled`` when its ranks went
        silent; else ``finished`` when stage 2 ended it for idleness; else ``running``."""
        if self.ended:
            return self.ended
        if stalled:
            return "stalled"
        return "finished" if idle_finished else "running"

    def config_json(self) -> str:
        return json.dumps(self.config, sort_keys=True, allow_nan=False, default=str)

    def to_state(self) -> dict[str, Any]:
        return {
            "started_ns": self.started_ns,
            "config": self.config,
            "ended": self.ended,
            "ended_ns": self.ended_ns,
            "error": self.error,
            "attempt": self.attempt,
            "past": self.past,
            "config_order": list(self.config_order),
            "note": [self.note, list(self.tags), self.note_ns],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> RunLifecycle:
        run = cls()
        if state:
            run.started_ns, run.config = int(state["started_ns"]), dict(state["config"])
            run.ended, run.ended_ns = state["ended"], int(state["ended_ns"])
            run.error = str(state.get("error", ""))
            run.attempt, run.past = str(state.get("attempt", "")), list(state.get("past", ()))
            step, seq = state.get("config_order", (-2, -1))  # absent: saved before attempts
            run.config_order = (int(step), int(seq))
            note, tags, at = state.get("note", ("", (), -1))  # absent: saved before notes
            run.note, run.tags, run.note_ns = str(note), tuple(tags), int(at)
        return run
