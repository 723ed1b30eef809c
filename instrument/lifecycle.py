"""Run lifecycle events, and the transports a rank builds from its environment.

A run says three things about itself on the topic ``probewire.runs`` (key = run_id, JSON);
the stream turns them into the run's ``runs`` row (``stream.lifecycle``)::

    {"run_id", "event": "started",  "rank": 0, "world_size", "time_unix_nano", "config": {...}}
    {"run_id", "event": "finished", "rank": 0, "world_size", "time_unix_nano"}
    {"run_id", "event": "crashed",  "rank": r, "world_size", "time_unix_nano", "error": "..."}
    {"run_id", "event": "note", "time_unix_nano", "note": "...", "tags": [...]}

Rank 0 announces the start (with the run's configuration, the hyper-parameters given to
``attach``) and the end (``Monitor.close``); any rank announces a crash (an exception out
of a step context, or ``Monitor.crashed``); ``probewire ui`` sends a ``note`` (the run's
note and tags, ``note_event``: the UI never writes the store itself). Every rank event also carries ``attempt`` (which
launch and restart it belongs to, the same on every rank: ``attempt_id``), ``step`` (the
rank's step, -1 when none) and ``seq`` (this process's event counter): the stream orders
events by those, never by the ranks' clocks.

``env_transports`` builds the metrics transport, the control listener and the event
transports from the variables ``probewire up`` / ``probewire run`` export, so ``attach``
needs no transport inside them: ``PROBEWIRE_KAFKA__BOOTSTRAP`` and, optionally, the topic
names ``PROBEWIRE_TOPICS__METRICS``, ``__DETAIL``, ``__CONTROL``, ``__CHECKPOINTS`` and ``__RUNS`` (the
names the settings tree reads too).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .control import ControlListener
from .export import KafkaTransport, Transport
from .spool import SpoolTransport, spool_file
from .wire import RankIdentity

__all__ = [
    "ATTEMPT_ENV",
    "BOOTSTRAP_ENV",
    "DETAIL_TOPIC",
    "EnvTransports",
    "MAX_CONFIG_BYTES",
    "MODES",
    "MODE_ENV",
    "RUNS_TOPIC",
    "attempt_id",
    "env_transports",
    "note_event",
    "offline_transports",
    "resolve_mode",
    "run_event",
]

log = logging.getLogger(__name__)

BOOTSTRAP_ENV = "PROBEWIRE_KAFKA__BOOTSTRAP"
ATTEMPT_ENV = "PROBEWIRE_ATTEMPT"
MODE_ENV = "PROBEWIRE_MODE"
MODES = ("online", "offline", "disabled")
RUNS_TOPIC = "probewire.runs"
MAX_CONFIG_BYTES = 64 * 1024
EVENTS = ("started", "finished", "crashed")
DETAIL_TOPIC = "otlp_detail"
_TOPICS = {
    "metrics": "otlp_metrics",
    "detail": DETAIL_TOPIC,
    "control": "probewire.control",
    "checkpoints": "probewire.checkpoints",
    "runs": RUNS_TOPIC,
}
_SEQ = itertools.count(1)  # this process's lifecycle events, in the order it sent them


def attempt_id(env: Mapping[str, str]) -> str:
    """The launch and restart every rank of this attempt shares: the launch is
    ``PROBEWIRE_ATTEMPT`` (``probewire run`` sets one per command), else torchrun's
    rendezvous id, else SLURM's job id; the restart is the launcher's restart count
    (``TORCHELASTIC_RESTART_COUNT`` / ``SLURM_RESTART_COUNT``). "" when the launcher says
    nothing (the stream then orders the events by their time)."""
    launch = env.get(ATTEMPT_ENV, "")
    if not launch and env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        launch = f"torchrun:{env['TORCHELASTIC_RUN_ID']}"
    if not launch and env.get("SLURM_JOB_ID"):
        launch = f"slurm:{env['SLURM_JOB_ID']}"
    if not launch:
        return ""
    restart = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT") or "0"
    return f"{launch[:180]}:{restart[:10]}"


def run_event(
    identity: RankIdentity,
    event: str,
    *,
    config: Mapping[str, Any] | None = None,
    error: str | None = None,
    now_ns: int | None = None,
    step: int = -1,
    attempt: str | None = None,
) -> bytes:
    """One lifecycle message. The config must be a mapping; values JSON cannot hold are
    written as text; a config over ``MAX_CONFIG_BYTES`` is refused (ValueError). The
    attempt is ``attempt_id(os.environ)`` unless given."""
    if event not in EVENTS:
        raise ValueError(f"event must be one of {EVENTS}, got {event!r}")
    body: dict[str, Any] = {
        "run_id": identity.run_id,
        "event": event,
        "rank": identity.rank,
        "world_size": identity.world_size,
        "time_unix_nano": time.time_ns() if now_ns is None else now_ns,
        "attempt": attempt_id(os.environ) if attempt is None else attempt,
        "step": max(int(step), -1),
        "seq": next(_SEQ),
    }
    if config is not None:
        if not isinstance(config, Mapping):
            raise ValueError(f"run_config must be a mapping, got {type(config).__name__}")
        text = json.dumps(dict(config), default=str, sort_keys=True)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(
                f"run_config is {len(text)} bytes as JSON; the limit is {MAX_CONFIG_BYTES}"
            )
        body["config"] = json.loads(text, parse_constant=lambda _: None)  # NaN/Inf: null
    if error is not None:
        body["error"] = error[:1000]
    return json.dumps(body, allow_nan=False, default=str).encode()


def note_event(run_id: str, note: str, tags: list[str], now_ns: int | None = None) -> bytes:
    """The ``note`` message that sets a run's note and tags (``stream.lifecycle`` checks
    it: the newest note of a run wins)."""
    body = {
        "run_id": run_id,
        "event": "note",
        "time_unix_nano": time.time_ns() if now_ns is None else now_ns,
        "note": note,
        "tags": tags,
    }
    return json.dumps(body).encode()


@dataclass(slots=True)
class EnvTransports:
    transport: Transport
    control: ControlListener | None
    checkpoints: Transport | None
    runs: Transport
    detail: Transport | None = None  # scan-tier points and ring dumps (``export``)


def resolve_mode(mode: str | None, env: Mapping[str, str]) -> str:
    """``mode``, else ``PROBEWIRE_MODE``, else ``online``; a ValueError naming the choices."""
    chosen = (mode or env.get(MODE_ENV) or "online").strip().lower()
    if chosen not in MODES:
        raise ValueError(
            f"probewire mode must be one of {', '.join(MODES)} (attach(mode=...) or "
            f"{MODE_ENV}), got {chosen!r}"
        )
    return chosen


def offline_transports(identity: RankIdentity, env: Mapping[str, str]) -> EnvTransports:
    """Offline mode: every message to this process's spool file (``spool``); no control
    listener, no socket."""
    spool = spool_file(identity.run_id, identity.rank, env)
    log.info("probewire: offline; messages spooled to %s", spool.path)
    return EnvTransports(
        transport=SpoolTransport(spool, "metrics"),
        detail=SpoolTransport(spool, "detail"),
        control=None,
        checkpoints=SpoolTransport(spool, "checkpoints") if identity.rank == 0 else None,
        runs=SpoolTransport(spool, "runs"),
    )


def topic_names(env: Mapping[str, str]) -> dict[str, str]:
    return {
        key: env.get(f"PROBEWIRE_TOPICS__{key.upper()}") or default
        for key, default in _TOPICS.items()
    }


def env_transports(identity: RankIdentity, env: Mapping[str, str]) -> EnvTransports:
    """Kafka transports to the broker named by ``PROBEWIRE_KAFKA__BOOTSTRAP``; a ValueError
    that says what to do when it is not set."""
    bootstrap = env.get(BOOTSTRAP_ENV, "").strip()
    if not bootstrap:
        raise ValueError(
            f"no transport: pass transport=..., or run the script under "
            f"`probewire run -- ...`, or export {BOOTSTRAP_ENV} (printed by "
            "`probewire up`)"
        )
    config = {"bootstrap.servers": bootstrap}
    _warn_if_unreachable(config)
    topics = topic_names(env)
    return EnvTransports(
        transport=KafkaTransport(config, topics["metrics"]),
        detail=KafkaTransport(config, topics["detail"]),
        control=ControlListener(
            config, run_id=identity.run_id, rank=identity.rank, topic=topics["control"]
        ),
        checkpoints=KafkaTransport(config, topics["checkpoints"]) if identity.rank == 0 else None,
        runs=KafkaTransport(config, topics["runs"]),
    )


def _warn_if_unreachable(config: Mapping[str, str], timeout_s: float = 2.0) -> None:
    """Say once, at attach, when the first bootstrap address does not answer as a Kafka
    broker within ``timeout_s`` (nothing listens: a stale export after ``probewire up``
    stopped; or a port that is not Kafka); training goes on, unmonitored until it does."""
    bootstrap = config["bootstrap.servers"]
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or str(exc)
    else:
        reason = _kafka_answer(config, timeout_s)
    if reason:
        log.warning(
            "probewire: no Kafka broker answers at %s (%s): this run's measurements are "
            "dropped until one does; is `probewire up` running?",
            bootstrap,
            reason,
        )


def _kafka_answer(config: Mapping[str, str], timeout_s: float) -> str:
    """ "" when the endpoint answers a Kafka metadata request within ``timeout_s``, else why
    not (a port that takes connections but is not Kafka times out)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from .kafkalog import kafka_log

    settings: dict[str, Any] = {**config, "logger": kafka_log}  # librdkafka takes a logger
    admin = AdminClient(settings)
    try:
        admin.list_topics(timeout=timeout_s)
    except KafkaException as exc:
        error = exc.args[0] if exc.args else exc
        return f"not a Kafka answer within {timeout_s:g}s: {getattr(error, 'str', lambda: error)()}"
    return ""
