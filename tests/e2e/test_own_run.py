"""`probewire run` around a user's torchrun script (examples/train_torchrun.py, the README's
snippet): the store answers live while it trains, and afterwards holds the finished run,
its config, its learning rates and, at every step, L equal to the script's own float64 L;
the held-out accuracy both ranks logged with ``s.log("val_acc", acc)`` is stored as the mean
over ranks the script computed, read back with ``probewire sql`` and listed by ``runs``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLE = "examples/train_torchrun.py"
REL = 1e-12  # float64 sums of the same float32 token losses, in another order
WORK = ".probewire-store"  # the session's work dir next to a store named "store"


def test_run_wraps_torchrun_with_live_reads_and_exact_loss(scratch_dir: Path, e2e) -> None:
    store, trace = scratch_dir / "store", scratch_dir / "trace.jsonl"
    steps = 60
    # copied into the README: probewire run --store S -- torchrun --nproc-per-node 2 ...
    cmd = e2e.probewire(
        "run",
        "--store",
        str(store),
        "--run-id",
        "own1",
        "--",
        *e2e.torchrun(),
        "--nproc-per-node",
        "2",
        EXAMPLE,
        "--steps",
        str(steps),
        "--sleep-s",
        "0.25",
        "--trace",
        str(trace),
    )
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=e2e.REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    counts: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            out = e2e.sql(
                store, "SELECT count() AS n FROM probewire.step_metrics FINAL WHERE run_id = 'own1'"
            )
            if out.returncode == 0:
                counts.append(json.loads(out.stdout)[0]["n"])
            else:  # before the worker owns the store, there is nothing to read yet
                assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    # live: at least two different, growing, partial counts while the script trained
    partial = [n for n in counts if 0 < n < steps]
    assert len(set(partial)) >= 2 and partial == sorted(partial), counts
    # progress on a pipe: plain lines every few seconds, growing, some while it trained
    shown = [int(n) for n in re.findall(r"^probewire: run own1: (\d+) steps stored", stderr, re.M)]
    assert len(shown) >= 2 and shown == sorted(shown), stderr[-3000:]
    assert any(0 < n < steps for n in shown), shown
    # the end: pages and the next commands, with run id and store filled in
    assert "run own1: finished, 60 steps stored" in stdout
    assert "your metrics (user_metrics): val_acc" in stdout
    assert f"probewire report --run own1 --store {store}" in stdout
    assert "probewire explain --run own1 --step " in stdout
    e2e.assert_nothing_left(store.parent / WORK)

    [run] = e2e.rows(store, "SELECT status, config FROM probewire.runs FINAL WHERE run_id = 'own1'")
    assert run["status"] == "finished"
    assert json.loads(run["config"]) == {
        "lr": 3e-3,
        "steps": steps,
        "warmup": 10,
        "probewire.scan_backend": "eager",
    }
    rows = e2e.rows(
        store,
        "SELECT step, loss, lr, lr_groups FROM probewire.step_metrics "
        "FINAL WHERE run_id = 'own1' ORDER BY step",
    )
    own = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["step"] for r in rows] == [o["step"] for o in own] == list(range(steps))
    for row, ref in zip(rows, own):
        assert row["loss"] == pytest.approx(ref["loss"], rel=REL, abs=0), row["step"]
        assert row["lr"] == ref["lr"] and row["lr_groups"] == {"0": ref["lr"]}
    logged = e2e.rows(
        store,
        "SELECT step, value, reduction FROM probewire.user_metrics FINAL "
        "WHERE run_id = 'own1' AND name = 'val_acc' ORDER BY step",
    )
    expected = [(o["step"], o["val_acc"]) for o in own if "val_acc" in o]
    assert [o["step"] for o in own if "val_acc" in o] == list(range(0, steps, 10))
    # (a + b) / 2 in float64 either way: the same double
    assert [(r["step"], r["value"]) for r in logged] == expected
    assert {r["reduction"] for r in logged} == {"mean"}
    listed = subprocess.run(
        e2e.probewire("runs", "--store", str(store)),
        capture_output=True,
        text=True,
        cwd=e2e.REPO,
        timeout=120,
    )
    assert listed.returncode == 0 and "user_metrics" in listed.stdout, listed.stderr
    assert any("own1" in line and "val_acc" in line for line in listed.stdout.splitlines())
