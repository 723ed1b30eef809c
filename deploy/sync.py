"""``probewire sync DIR``: replay the spool files of offline ranks (``instrument.spool``).

Each record goes to the topic it would have gone to live (its kind: the settings' metrics,
detail, runs or checkpoints topic), in an order the stream takes as live: per run, the ``started``
events first, then the step messages by step (every rank's message of a step together, so
none is late for its step's deadline), then the other events. With ``--store`` (an embedded
store) the local stack starts, or a live ``probewire up`` on it is joined, and ``sync``
returns once the worker stored the replayed steps; otherwise the records go to the
configured Kafka (``kafka.bootstrap``) and ``sync`` returns once the broker has them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from probewire.deploy.health import read_heartbeat
from probewire.deploy.session import (
    SessionError,
    start,
    status_line,
    stop_session,
    wait_stored,
)
from probewire.deploy.settings import Settings
from probewire.instrument.spool import SpoolError, read_spool

__all__ = ["replay_order", "spooled", "sync"]

Record = tuple[str, bytes, bytes]


def spooled(folder: Path) -> list[Record]:
    """Every record of every ``*.spool`` file in ``folder``; a SessionError when none."""
    if not folder.is_dir():
        raise SessionError(f"no spool folder {folder}; pass the PROBEWIRE_SPOOL_DIR of the run")
    files = sorted(folder.glob("*.spool"))
    if not files:
        raise SessionError(f"no *.spool files in {folder}")
    try:
        return [record for path in files for record in read_spool(path)]
    except SpoolError as exc:
        raise SessionError(str(exc)) from None


def _run_and_rank(record: Record) -> tuple[str, float]:
    """(run id, order within the run): started -1, a step message its step, the rest +inf."""
    kind, key, value = record
    if kind in ("metrics", "detail"):
        run_id, _, text = key.decode(errors="replace").rpartition(":")
        return run_id, float(text) if text.isdigit() else math.inf
    try:
        body = json.loads(value)
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    if kind == "runs" and body.get("event") == "started":
        return key.decode(errors="replace"), -1.0
    at = body.get("step")
    order = float(at) if kind == "checkpoints" and isinstance(at, int) else math.inf
    return key.decode(errors="replace"), order


def replay_order(records: Iterable[Record]) -> list[Record]:
    """The records in the order to publish (see the module docstring); stable otherwise."""
    return sorted(records, key=_run_and_rank)


def _publish(bootstrap: str, settings: Settings, records: list[Record]) -> int:
    """Publish every record; how many the broker did not confirm within 60 s."""
    from confluent_kafka import Producer

    topics = {
        "metrics": settings.topics.metrics,
        "detail": settings.topics.detail,
        "runs": settings.topics.runs,
        "checkpoints": settings.topics.checkpoints,
    }
    client = {**settings.kafka.client_config(), "bootstrap.servers": bootstrap}
    producer = Producer({**client, "acks": "all", "max.in.flight.requests.per.connection": 1})
    failed: list[object] = []

    def delivered(error: object, _message: object) -> None:
        if error is not None:
            failed.append(error)

    for kind, key, value in records:
        while True:
            try:
                producer.produce(topics[kind], key=key, value=value, on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.1)
    return producer.flush(60.0) + len(failed)


def sync(settings: Settings, folder: Path, work_dir: Path | None) -> int:
    """Replay ``folder`` (see the module docstring); ``work_dir`` None: no local stack."""
    records = replay_order(spooled(folder))
    runs = sorted({_run_and_rank(r)[0] for r in records})
    if work_dir is None:
        left = _publish(settings.kafka.bootstrap, settings, records)
        if left:
            raise SessionError(f"{left} of {len(records)} record(s) not confirmed by the broker")
        print(f"probewire: {len(records)} record(s) of run(s) {', '.join(runs)} published")
        return 0
    session = start(settings, work_dir, reuse=True)
    try:
        left = _publish(session.bootstrap, settings, records)
        if left:
            raise SessionError(f"{left} of {len(records)} record(s) not confirmed by the broker")
        wait_stored(session, runs)
        print(
            f"probewire: {len(records)} record(s) replayed; {status_line(read_heartbeat(session.heartbeat))}"
        )
    finally:
        stop_session(session)
    return 0
