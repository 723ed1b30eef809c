"""What a service process needs around it: the worker's store (and its live reader), and the
preflight every service runs on start (directories, a broker that answers, topics)."""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path

from probewire.deploy.settings import Settings, split_credentials
from probewire.deploy.stack import StackError, create_topics, topic_message_bytes

__all__ = ["PreflightError", "open_store", "preflight"]

log = logging.getLogger(__name__)


class PreflightError(Exception):
    """The service cannot start; the message is one line with the fix."""


_READERS: list = []  # the live reader of the store this worker process owns


def open_store(settings: Settings, read_port: int = 0):
    """A migrated sink on the configured store (called in the worker process). An embedded
    store is also served read-only on 127.0.0.1:``read_port`` (0: a free port, -1: off),
    so queries work while the worker owns it (``sinks.readserver``)."""
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from probewire.deploy.fault_injection import with_outage
    from probewire.sinks.clickhouse import (
        ClickHouseSink,
        StoreUnavailable,
        connect,
        lower_merge_priority,
    )

    ch = settings.clickhouse
    try:
        client = with_outage(connect(ch.url, username=ch.username, password_env=ch.password_env))
    except ClickHouseError as exc:  # unreachable or refusing: the worker retries (and says so)
        raise StoreUnavailable(
            f"cannot connect to {split_credentials(ch.url)[0]}: {str(exc).strip().splitlines()[0]}"
        ) from None
    sink = ClickHouseSink(client, ch.database, ch.retry_max_s, batch_rows=ch.batch_rows)
    sink.migrate(
        sensitive_artifacts=ch.sensitive_artifacts, sensitive_ttl_days=ch.sensitive_ttl_days
    )
    if ch.url.startswith("chdb:///"):  # its merges take the CPU the page path leaves
        lower_merge_priority(settings.stream.detail_nice)
    if ch.url.startswith("chdb:///") and read_port >= 0 and not _READERS:
        from probewire.sinks.readserver import READER_TOKEN_ENV, ReadServer

        try:
            reader = ReadServer(
                ch.url[len("chdb://") :],
                port=read_port,
                token=os.environ.get(READER_TOKEN_ENV, ""),
            )
        except OSError as exc:  # the port is taken: the worker runs on, without live reads
            log.error("probewire: no live reads: cannot serve on 127.0.0.1:%d (%s)", read_port, exc)
            return sink
        reader.start()
        _READERS.append(reader)
        atexit.register(reader.close)  # the store's address file goes with the worker
    return sink


READ_COMMANDS = frozenset({"sql", "runs", "report", "explain", "calibrate"})
"""The CLI's read commands that open an idle embedded store for one query and exit."""

READ_WAIT_S = 5.0
"""How long a service waits for one of ``READ_COMMANDS`` to let go of the store: it holds
the store for its query only (a second or two), so a service starting beside a person's
``probewire sql`` is not refused for it; any other holder is refused at once."""


def _read_command(pid: int) -> bool:
    """Whether process ``pid`` is a probewire read command (``probewire sql ...``)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return False
    for before, word in zip(argv, argv[1:]):
        if before.endswith(("probewire", "probewire.deploy.cli")):
            return word in READ_COMMANDS
    return False


def held_store(settings: Settings, read_wait_s: float = READ_WAIT_S) -> str | None:
    """One line naming the process that holds the embedded store of ``settings`` (chdb: one
    process per data directory), or None when it is free or not embedded. A read command
    that holds it is waited for, up to ``read_wait_s``."""
    from probewire.deploy.reading import chdb_path
    from probewire.sinks.readserver import owner_pid, store_owner

    path = chdb_path(settings.clickhouse.url)
    if path is None:
        return None
    deadline = time.monotonic() + read_wait_s
    while (pid := owner_pid(path)) is not None and _read_command(pid):
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    owner = store_owner(path)
    if owner is None:
        return None
    return (
        f"the store {path} is held by {owner}; stop it, or pass another --store DIR "
        "(clickhouse.url)"
    )


def preflight(settings: Settings, heartbeat: Path, *, owns_store: bool = False) -> None:
    """What a service needs on a fresh machine: the store it owns free (one line naming
    its holder otherwise, at once), its heartbeat directory, a broker that answers (one
    line after a bounded wait otherwise) and the topics it reads."""
    held = held_store(settings) if owns_store else None
    if held is not None:
        raise PreflightError(held)
    heartbeat.parent.mkdir(parents=True, exist_ok=True)
    try:
        create_topics(
            settings.kafka.client_config(),
            settings.topics.all(),
            timeout_s=8.0,
            message_bytes=topic_message_bytes(settings),
        )
    except StackError as exc:
        raise PreflightError(str(exc)) from None
