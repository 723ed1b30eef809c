"""Helpers for the end-to-end tests that run a user's script under ``probewire run``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]


def torchrun() -> list[str]:
    """``torchrun`` of this interpreter's environment (or its module form)."""
    found = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def probewire(*args: str) -> list[str]:
    return [sys.executable, "-m", "probewire.deploy.cli", *args]


def sql(store: Path, query: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``probewire sql --store S --format json QUERY`` in a fresh process."""
    return subprocess.run(
        probewire("sql", "--store", str(store), "--format", "json", query),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rows(store: Path, query: str) -> list[dict]:
    out = sql(store, query)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def assert_nothing_left(work_dir: Path) -> None:
    """Every process the session recorded (broker, worker, the command) has exited."""
    started = json.loads((work_dir / "processes.json").read_text())
    alive = [
        p
        for p in started
        if psutil.pid_exists(p["pid"]) and psutil.Process(p["pid"]).status() != psutil.STATUS_ZOMBIE
    ]
    assert not alive, f"left running: {alive}"


def run_script(
    store: Path, run_id: str, script: str, *args: str, timeout: float = 400
) -> subprocess.CompletedProcess:
    """``probewire run --store S --run-id ID -- torchrun --nproc-per-node 2 SCRIPT ARGS``."""
    cmd = probewire(
        "run",
        "--store",
        str(store),
        "--run-id",
        run_id,
        "--",
        *torchrun(),
        "--nproc-per-node",
        "2",
        str(REPO / script),
        *args,
    )
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=store.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.fixture()
def e2e():
    """The helpers above, as a namespace."""
    import types

    return types.SimpleNamespace(
        REPO=REPO,
        torchrun=torchrun,
        probewire=probewire,
        sql=sql,
        rows=rows,
        assert_nothing_left=assert_nothing_left,
        run_script=run_script,
    )
