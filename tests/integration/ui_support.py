"""What the UI tests share: synthetic runs written through the project's writer, and a
real ``probewire ui`` process reading the test's embedded store through a live reader
(``sinks.readserver``, as a worker serves it), stopped by PID."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from probewire.sinks import ClickHouseSink
from probewire.sinks.readserver import ReadServer

LR = 0.003
TOKENS_PER_STEP = 4096 * 64
FLOPS_PER_STEP = 6 * 1.2e9 * TOKENS_PER_STEP


def step_columns(run_id: str, start: int, stop: int, *, seed: int = 0, spike: int | None = None):
    """Rows ``start..stop-1`` of a synthetic run's ``step_metrics`` (column-wise): a
    decaying loss with noise, G2 with a one-step spike of 1e4 at ``spike``, a constant lr,
    counters, step time, throughput and memory."""
    rng = np.random.default_rng(seed * 1_000_003 + start)
    step = np.arange(start, stop, dtype=np.int64)
    loss = 2.0 + 8.0 / np.sqrt(1.0 + step / 50.0) + rng.normal(0, 0.02, step.size)
    grad = rng.lognormal(0.0, 0.1, step.size)
    if spike is not None and start <= spike < stop:
        grad[spike - start] = 1e4
    return {
        "run_id": [run_id] * step.size,
        "step": step.tolist(),
        "tokens": ((step + 1) * TOKENS_PER_STEP).tolist(),
        "flops": ((step + 1) * FLOPS_PER_STEP).astype(np.float64).tolist(),
        "loss": loss.tolist(),
        "loss_worst_rank": (loss + np.abs(rng.normal(0, 0.05, step.size))).tolist(),
        "grad_norm": grad.tolist(),
        "lr": [LR] * step.size,
        "cospike_count": (step // 5000).tolist(),
        "step_time_s": rng.normal(0.5, 0.01, step.size).tolist(),
        "tokens_per_s": rng.normal(5e5, 1e3, step.size).tolist(),
        "peak_memory_bytes": rng.normal(60 * 2**30, 2**27, step.size).tolist(),
    }


def write_run(
    sink: ClickHouseSink,
    run_id: str,
    steps: int,
    *,
    start: int = 0,
    seed: int = 0,
    spike: int | None = None,
    tags: tuple[str, ...] = (),
    status: str = "running",
) -> None:
    """Steps ``start..steps-1`` of a synthetic run, its ``runs`` row, and (with ``spike``)
    an anomaly and a page at the spike's step."""
    sink.write_columns("step_metrics", step_columns(run_id, start, steps, seed=seed, spike=spike))
    sink.write(
        "runs",
        [
            {
                "run_id": run_id,
                "world_size": 8,
                "first_step": 0,
                "last_step": steps - 1,
                "status": status,
                "config": json.dumps({"tags": list(tags)}),
            }
        ],
    )
    if spike is not None and start <= spike < steps:
        sink.write(
            "anomalies",
            [
                {
                    "run_id": run_id,
                    "step": spike,
                    "signal": "grad_norm",
                    "kind": "spike",
                    "value": 1e4,
                    "baseline": 1.0,
                    "z": 50.0,
                    "culprit": "",
                }
            ],
        )
        sink.write(
            "alerts",
            [
                {
                    "run_id": run_id,
                    "step": spike,
                    "signal": "grad_norm",
                    "severity": "page",
                    "value": 1e4,
                    "baseline": 1.0,
                    "z": 50.0,
                    "message": "G2 spiked",
                }
            ],
        )


def write_user_metric(
    sink: ClickHouseSink, run_id: str, name: str, per_rank: np.ndarray, steps: list[int]
) -> np.ndarray:
    """A user metric the run's ranks logged with ``s.log(name, value)`` (mean over ranks):
    ``per_rank[i, r]`` is rank r's value at ``steps[i]``; each step's reduced points (Σ of
    the values, 1 per rank) become ``user_metrics`` rows as stage 2 writes them
    (``stream.usermetrics.user_rows``). Returns the stored values (float64)."""
    from probewire.instrument.catalog import Label, User
    from probewire.stream.usermetrics import user_rows

    labels = ((Label.NAME, name),)
    rows = []
    for step, values in zip(steps, per_rank):
        reduced = {(User.MEAN, labels): float(np.sum(values)), (User.RANKS, labels): 8.0}
        rows += user_rows(run_id, step, reduced)
    sink.write("user_metrics", rows)
    return np.array([r["value"] for r in rows], dtype=np.float64)


@dataclass(frozen=True)
class UI:
    """A running UI: its base URL and its token."""

    base: str
    token: str

    def url(self, path: str) -> str:
        """``path`` (with its query) on this UI, carrying the token."""
        joiner = "&" if "?" in path else "?"
        return f"{self.base}{path}{joiner}token={self.token}"


@contextmanager
def ui_server(store: Path, database: str) -> Iterator[UI]:
    """A live reader of this process over ``store`` (published, as a worker's), and a
    ``probewire ui --port 0`` process reading through it; yields the UI's URL."""
    reader = ReadServer(store, token=secrets.token_urlsafe(24))
    reader.start()
    env = {**os.environ, "PROBEWIRE_CLICKHOUSE__DATABASE": database}
    proc = subprocess.Popen(
        [sys.executable, "-m", "probewire.deploy.cli", "ui", "--store", str(store), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.startswith("probewire ui: http://127.0.0.1:"):
            rest = proc.stdout.read() if proc.stdout and proc.poll() is not None else ""
            raise AssertionError(f"probewire ui did not start: {line!r} {rest[-2000:]}")
        printed = urllib.parse.urlsplit(line.split(": ", 1)[1].strip())
        ui = UI(f"http://{printed.netloc}", urllib.parse.parse_qs(printed.query)["token"][0])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(ui.url("/api/runs"), timeout=10).read()
                break
            except urllib.error.HTTPError:
                break  # it answers (an unmigrated store's error is an answer)
            except OSError:
                time.sleep(0.2)
        yield ui
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)
        reader.close()


def get(url: str, timeout_s: float = 60.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
