"""`probewire demo` leaves no process and no open port behind: on success, on error, on Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from processes import finish

pytestmark = pytest.mark.integration


def _demo(work: Path, steps: int, sigint_ignored: bool = False) -> subprocess.Popen:
    """``sigint_ignored``: started as a shell script's background job is (SIGINT ignored)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "probewire.deploy.cli",
            "demo",
            "--steps",
            str(steps),
            "--store",
            str(work / "store"),
            "--work-dir",
            str(work / "run"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if sigint_ignored
        else None,
    )


def _started(work: Path) -> list[dict]:
    path = work / "run" / "processes.json"
    return json.loads(path.read_text()) if path.exists() else []


def _wait_for(work: Path, what: str, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        started = _started(work)
        if any(p["what"] == what for p in started):
            return started
        time.sleep(0.2)
    raise AssertionError(f"{what} never started; saw {_started(work)}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
        return True
    except OSError:
        return False


def _assert_clean(started: list[dict]) -> None:
    assert {p["what"] for p in started} >= {"broker", "worker", "rank0", "rank1"}
    alive = [p for p in started if _alive(p["pid"])]
    assert not alive, f"left running: {alive}"
    ports = [p["port"] for p in started if p["port"] and _listening(p["port"])]
    assert not ports, f"ports still open: {ports}"


def test_success_prints_the_table_and_stops_everything(scratch_dir: Path) -> None:
    proc = _demo(scratch_dir, steps=20)
    out, err = finish(proc, 300)
    assert proc.returncode == 0, err
    assert "L_max" in out and "last 10 of 20 steps" in out.replace("\n", " ")
    # the result: status, pages and the next commands with the run id and store filled in
    store = scratch_dir / "store"
    assert ": finished, 20 steps stored" in out and "next:" in out
    assert "probewire report --run demo-" in out and f"--store {store}" in out
    _assert_clean(_started(scratch_dir))


def test_a_failing_rank_is_an_error_and_stops_everything(scratch_dir: Path) -> None:
    proc = _demo(scratch_dir, steps=100_000)
    started = _wait_for(scratch_dir, "rank1")
    rank1 = next(p["pid"] for p in started if p["what"] == "rank1")
    time.sleep(2.0)  # let training start
    os.kill(rank1, signal.SIGKILL)
    out, err = finish(proc, 180)
    assert proc.returncode == 2
    assert "training rank exited" in err and "Traceback" not in err
    _assert_clean(_started(scratch_dir))


def test_ctrl_c_stops_everything(scratch_dir: Path) -> None:
    """Also when started as a script's background job (CI's runner may start it so): Python
    would leave the inherited SIGINT ignored and the demo ran on."""
    proc = _demo(scratch_dir, steps=100_000, sigint_ignored=True)
    _wait_for(scratch_dir, "rank1")
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    out, err = finish(proc, 180)
    assert proc.returncode == 130
    assert "interrupted" in err and "Traceback" not in err
    _assert_clean(_started(scratch_dir))


def test_children_die_with_a_killed_demo(scratch_dir: Path) -> None:
    """SIGKILL runs no cleanup code; the children still stop (parent-death signal)."""
    proc = _demo(scratch_dir, steps=100_000)
    _wait_for(scratch_dir, "rank1")
    time.sleep(2.0)
    proc.kill()
    proc.communicate(timeout=30)
    started = _started(scratch_dir)
    deadline = time.monotonic() + 60
    while any(_alive(p["pid"]) for p in started) and time.monotonic() < deadline:
        time.sleep(0.5)
    _assert_clean(started)
