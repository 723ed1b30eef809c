"""`probewire up`: the stack for a script the user starts themselves. It prints the
variables the script needs; with them, an unmodified torchrun script reports to it; sql,
explain and report read the store live through the worker; `probewire run` on the same
store joins the session; Ctrl-C stops everything it started."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from processes import finish

pytestmark = pytest.mark.integration


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)


def _wait_line(lines: queue.Queue, seen: list[str], needle: str, timeout_s: float = 180) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"no line with {needle!r}; saw {seen}")


def test_up_serves_a_users_torchrun_script_and_stops_on_ctrl_c(scratch_dir: Path, e2e) -> None:
    store = scratch_dir / "store"
    # copied into the README: probewire up --store S
    up = subprocess.Popen(
        e2e.probewire("up", "--store", str(store)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=scratch_dir,
    )
    lines: queue.Queue = queue.Queue()
    seen: list[str] = []
    threading.Thread(target=_lines, args=(up.stdout, lines), daemon=True).start()
    try:
        _wait_line(lines, seen, "Ctrl-C stops everything")
        exports = dict(
            line.strip().removeprefix("export ").split("  #")[0].split("=", 1)
            for line in seen
            if line.strip().startswith("export PROBEWIRE_") and "RUN_ID" not in line
        )
        assert set(exports) >= {"PROBEWIRE_KAFKA__BOOTSTRAP", "PROBEWIRE_TOPICS__RUNS"}
        env = {**os.environ, **exports, "PROBEWIRE_RUN_ID": "up1", "OMP_NUM_THREADS": "1"}
        # the user's script, started by the user, with what `up` printed
        script = subprocess.run(
            [
                *e2e.torchrun(),
                "--nproc-per-node",
                "2",
                str(e2e.REPO / "examples" / "train_torchrun.py"),
                "--steps",
                "15",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert script.returncode == 0, script.stderr[-3000:]
        _wait_line(lines, seen, "up1 finished at step 14")
        # live: the worker owns the store and serves it
        [row] = e2e.rows(
            store,
            "SELECT count() AS n, max(lr) AS lr FROM probewire.step_metrics "
            "FINAL WHERE run_id = 'up1'",
        )
        assert row["n"] == 15 and row["lr"] == 3e-3
        explain = subprocess.run(
            e2e.probewire(
                "explain", "--run", "up1", "--step", "10", "--store", str(store), "--format", "json"
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert explain.returncode == 0, explain.stderr
        assert json.loads(explain.stdout)["step"] == 10
        # `health --store` finds the worker `up` started and its live reader (issue 36)
        health = subprocess.run(
            e2e.probewire("health", "--component", "worker", "--store", str(store)),
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "PROBEWIRE_HEARTBEAT_DIR"},
        )
        assert health.returncode == 0, health.stderr
        assert "live reads at http://127.0.0.1:" in health.stdout, health.stdout
        report = subprocess.run(
            e2e.probewire(
                "report",
                "--run",
                "up1",
                "--store",
                str(store),
                "--out",
                str(scratch_dir / "report"),
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert report.returncode == 0, report.stderr
        # the web UI `up` started (its URL printed) reads the same store live
        ui = next(line for line in seen if "probewire: web UI http://127.0.0.1:" in line)
        url = ui.split("web UI ", 1)[1].split()[0]  # http://127.0.0.1:PORT/?token=...
        with urllib.request.urlopen(url, timeout=60) as page:
            html = page.read().decode()
        assert "href='/run/up1'" in html
        # up gave it the broker: each run's note can be set (issue 39), never read-only
        assert "<form id='note-0' method='post'" in html and "notes-read-only" not in html
        base, token = url.split("/?token=")
        charts_url = f"{base}/api/charts?run=up1&token={token}"
        with urllib.request.urlopen(charts_url, timeout=60) as charts:
            lr = json.loads(charts.read())["charts"]["lr"]
        assert [max(line["y"]) for line in lr] == [3e-3]  # the lr as SQL reads it, above
        # `probewire run` on the same store joins the session instead of starting a stack
        joined = e2e.run_script(store, "up2", "examples/train_torchrun.py", "--steps", "5")
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert "run up2: finished, 5 steps stored" in joined.stdout
        assert up.poll() is None
    finally:
        up.send_signal(signal.SIGINT)
        _, err = finish(up, 120)
    assert up.returncode == 130 and "interrupted" in err and "Traceback" not in err
    started = json.loads((scratch_dir / ".probewire-store" / "processes.json").read_text())
    assert {p["what"] for p in started} == {"broker", "worker", "ui"}
    assert not [
        p
        for p in started
        if psutil.pid_exists(p["pid"]) and psutil.Process(p["pid"]).status() != psutil.STATUS_ZOMBIE
    ]
    assert not (scratch_dir / ".probewire-store" / "session.json").exists()
