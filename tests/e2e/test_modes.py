"""Modes (``PROBEWIRE_MODE``): ``disabled`` runs an instrumented script with no broker and
no stack, unchanged; ``offline`` spools its messages to local files, and ``probewire sync
DIR --store S`` replays them into a stack whose store then holds the same steps as a live
run of the same script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

SCRIPT = Path(__file__).with_name("job_script.py")
CLI = [sys.executable, "-m", "probewire.deploy.cli"]
COLUMNS = "step, loss, loss_worst_rank, tokens, step_tokens, ranks_reporting, complete_reason"


def script(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROBEWIRE_")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, "OMP_NUM_THREADS": "1", **env},
    )


def rows(store: Path, run_id: str) -> list[dict]:
    out = subprocess.run(
        [*CLI, "sql", "--store", str(store), "--format", "json"]
        + [
            f"SELECT {COLUMNS} FROM probewire.step_metrics FINAL WHERE run_id = '{run_id}' "
            "ORDER BY step"
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_disabled_runs_the_script_with_no_broker_and_no_run_id(tmp_path: Path) -> None:
    """No PROBEWIRE_RUN_ID, no broker variable: online ``attach`` refuses; disabled exits 0."""
    out = script({"PROBEWIRE_MODE": "disabled"}, "--steps", "3", "--sleep-s", "0")
    assert out.returncode == 0 and "step 2" in out.stdout, out.stderr[-2000:]
    online = script({}, "--steps", "3", "--sleep-s", "0")
    assert online.returncode != 0  # the same script online: no run id, no transport


def test_offline_then_sync_stores_the_same_steps_as_a_live_run(tmp_path: Path) -> None:
    store, spool = tmp_path / "store", tmp_path / "spool"
    live = subprocess.run(
        [*CLI, "run", "--store", str(store), "--run-id", "live1", "--"]
        + [sys.executable, str(SCRIPT), "--steps", "6", "--sleep-s", "0"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert live.returncode == 0, live.stderr[-3000:]
    off = script(
        {
            "PROBEWIRE_MODE": "offline",
            "PROBEWIRE_SPOOL_DIR": str(spool),
            "PROBEWIRE_RUN_ID": "off1",
        },
        "--steps",
        "6",
        "--sleep-s",
        "0",
    )
    assert off.returncode == 0, off.stderr[-2000:]
    assert len(list(spool.glob("off1.rank0.*.spool"))) == 1
    synced = subprocess.run(
        [*CLI, "sync", str(spool), "--store", str(store)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert synced.returncode == 0, synced.stderr[-3000:]
    assert "replayed" in synced.stdout
    got, want = rows(store, "off1"), rows(store, "live1")
    assert [r["step"] for r in got] == list(range(6))
    assert got == want
    [run] = json.loads(
        subprocess.run(
            [*CLI, "sql", "--store", str(store), "--format", "json"]
            + ["SELECT status, config FROM probewire.runs FINAL WHERE run_id = 'off1'"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    assert run["status"] == "finished" and json.loads(run["config"])["steps"] == 6
