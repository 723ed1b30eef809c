"""A service starting on an embedded store: a read command that holds the store for its one
query is waited for; any other holder is named at once (real processes, the engine's
``status`` file as chdb writes it)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from probewire.deploy.services import held_store
from probewire.deploy.settings import load_settings


def _holder(tmp_path: Path, command: str, seconds: float) -> subprocess.Popen:
    """A process whose command line is ``probewire COMMAND`` (a script named probewire), and
    a store whose ``status`` file names it, as the engine writes it."""
    script = tmp_path / "bin" / "probewire"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep({seconds})\n")
    script.chmod(0o755)
    proc = subprocess.Popen([str(script), command, "SELECT 1"])
    threading.Thread(target=proc.wait, daemon=True).start()  # reaped as a shell would
    store = tmp_path / "store"
    store.mkdir()
    (store / "status").write_text(f"PID: {proc.pid}\nStarted at: now\n")
    return proc


def _settings(tmp_path: Path):
    url = "chdb:///" + str(tmp_path / "store").lstrip("/")
    return load_settings(env={}, overrides={"clickhouse": {"url": url}})


@pytest.mark.parametrize(("command", "free"), [("sql", True), ("worker", False)])
def test_a_reader_is_waited_for_and_a_service_named_at_once(tmp_path, command, free):
    """`probewire sql` holds an idle store for its query only: a worker, demo or up starting
    beside it waits for it to end (test_own_run's live poll raced the worker's start); a
    worker holding the store is named at once."""
    proc = _holder(tmp_path, command, 1.0)
    try:
        start = time.monotonic()
        held = held_store(_settings(tmp_path))
        took = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    if free:  # the reader ended within the wait: the store is free
        assert held is None and took >= 0.5, (held, took)
    else:  # a service: refused at once, naming it
        assert held is not None and f"pid {proc.pid}" in held and took < 0.5, (held, took)


def test_a_reader_that_outlasts_the_wait_is_named(tmp_path):
    proc = _holder(tmp_path, "sql", 30.0)
    try:
        start = time.monotonic()
        held = held_store(_settings(tmp_path), read_wait_s=0.3)
        took = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert held is not None and f"pid {proc.pid}" in held and 0.3 <= took < 2.0, (held, took)
