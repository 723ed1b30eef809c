"""Many demo runs through one stack, and their results read back in one process.

``Gallery`` starts one broker and one stream worker writing one store, then trains runs
through them one after another, each with its own run id (a fault, a scenario, a
fault-free run). ``read_gallery`` reads what the worker stored, after it stopped (chdb: one
process per data directory), in a single fresh process: the SQL results asked for and,
per run, ``probewire explain`` at the step its page came (``Explain``). Tests and
``benchmarks/detectors.py`` use it; ``cpu_burner`` loads the host for the runs that need a
busy machine.

    python -m probewire.deploy.demo.gallery read --store DIR --spec SPEC.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probewire.deploy.settings import ClickHouseSettings, Settings
from probewire.deploy.stack import LocalStack, spawn, stop_process
from probewire.stream.config import StreamConfig
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import Stage2Config

from .run import DemoResult, train_run

__all__ = ["Explain", "Gallery", "cpu_burner", "read_gallery"]


@contextmanager
def cpu_burner(
    processes: int = 1, limit_s: float = 900.0, log: Path | None = None
) -> Iterator[list[int]]:
    """``processes`` busy loops, each bounded to ``limit_s`` seconds, stopped by PID on
    exit (their own sessions: nothing else is signalled); yields their PIDs."""
    code = (
        f"import time\nend = time.monotonic() + {float(limit_s)!r}\n"
        "while time.monotonic() < end:\n    pass\n"
    )
    procs = []
    sink = open(log or os.devnull, "ab")
    try:
        for _ in range(processes):
            procs.append(spawn([sys.executable, "-c", code], sink))
        yield [p.pid for p in procs]
    finally:
        for proc in procs:
            stop_process(proc)
        sink.close()


@dataclass(slots=True)
class Gallery:
    """One broker, one worker and one store for a series of demo runs."""

    work_dir: Path
    window: int = 50
    database: str = "probewire"
    bootstrap: str | None = None
    stage2: dict[str, Any] = field(default_factory=dict)  # other Stage2Config fields
    stack: LocalStack | None = None
    runs: list[str] = field(default_factory=list)

    @property
    def store(self) -> Path:
        return self.work_dir / "store"

    def settings(self) -> Settings:
        return Settings(
            clickhouse=ClickHouseSettings(
                url="chdb:///" + str(self.store).lstrip("/"), database=self.database
            ),
            stream=StreamConfig(
                app_id=f"probewire-{uuid.uuid4().hex[:8]}",
                stage2=Stage2Config(detectors=DetectorConfig(window=self.window), **self.stage2),
            ),
        )

    def start(self) -> None:
        if self.stack is not None:
            return
        self.work_dir.mkdir(parents=True, exist_ok=True)
        stack = LocalStack(self.settings(), self.work_dir / "stack")
        try:
            stack.use_broker(self.bootstrap) if self.bootstrap else stack.start_broker()
            stack.start_worker()
        except BaseException:
            stack.stop()
            raise
        self.stack = stack

    def run(
        self,
        run_id: str,
        *,
        ranks: int = 2,
        steps: int = 150,
        train_args: list[str] | None = None,
        trace: Path | None = None,
        burner: int = 0,
        timeout_s: float = 900.0,
    ) -> DemoResult:
        """Train one run through the shared stack (``burner`` busy loops alongside)."""
        self.start()
        assert self.stack is not None
        with cpu_burner(burner, limit_s=timeout_s) if burner else _nothing():
            result = train_run(
                self.stack,
                run_id=run_id,
                ranks=ranks,
                steps=steps,
                trace=trace,
                extra_train_args=train_args,
                timeout_s=timeout_s,
            )
        self.runs.append(run_id)
        return result

    def stop(self) -> None:
        """Stop the worker (it flushes) and the broker; the store can be read after this."""
        if self.stack is not None:
            self.stack.stop()
            self.stack = None

    def __enter__(self) -> Gallery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


@dataclass(frozen=True, slots=True)
class Explain:
    """Explain ``run_id`` at the first step ``signal`` paged at or after ``fallback`` (the
    fault's step: an early page of the same signal is not the fault's), else at
    ``fallback``."""

    run_id: str
    signal: str | None
    fallback: int
    window: int = 50


def read_gallery(
    store: Path,
    sql: dict[str, str],
    explains: Sequence[Explain] = (),
    database: str = "probewire",
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Run every query and explanation on ``store`` in one fresh process (another process
    wrote it): {"sql": {name: rows as dicts}, "explain": {run_id: explain's JSON}}."""
    spec = store.parent / f"read-{uuid.uuid4().hex[:8]}.json"
    spec.write_text(
        json.dumps(
            {"database": database, "sql": sql, "explain": [dataclasses.asdict(e) for e in explains]}
        )
    )
    try:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "probewire.deploy.demo.gallery",
                "read",
                "--store",
                str(store),
                "--spec",
                str(spec),
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        spec.unlink(missing_ok=True)
    if out.returncode != 0:
        raise RuntimeError(f"reading {store} failed ({out.returncode}): {out.stderr[-4000:]}")
    return json.loads(out.stdout)


def _read(store: Path, spec: dict[str, Any]) -> dict[str, Any]:
    from probewire.deploy.explain import explain
    from probewire.sinks.clickhouse import connect

    client = connect("chdb:///" + str(store.resolve()).lstrip("/"))
    db = spec["database"]

    def rows(query: str) -> list[dict[str, Any]]:
        result = client.query(query)
        return [dict(zip(result.column_names, r)) for r in result.result_rows]

    out: dict[str, Any] = {"sql": {name: rows(q) for name, q in spec["sql"].items()}, "explain": {}}
    for item in spec["explain"]:
        step = item["fallback"]
        if item["signal"]:
            first = client.query(
                f"SELECT step FROM {db}.alerts FINAL WHERE run_id = {{r:String}} "
                "AND signal = {s:String} AND step >= {f:UInt64} ORDER BY step LIMIT 1",
                parameters={"r": item["run_id"], "s": item["signal"], "f": item["fallback"]},
            )
            step = int(first.result_rows[0][0]) if first.result_rows else step
        result = explain(client, db, item["run_id"], step, window=item["window"])
        out["explain"][item["run_id"]] = {
            "step": step,
            "headline": result.headline(),
            "first": None if result.first is None else result.first.signal,
            "pages": [dataclasses.asdict(p) for p in result.pages],
            "findings": [dataclasses.asdict(f) for f in result.findings],
        }
    return out


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m probewire.deploy.demo.gallery")
    sub = parser.add_subparsers(dest="command", required=True)
    read = sub.add_parser("read", help="queries and explanations of a stopped store, as JSON")
    read.add_argument("--store", required=True, type=Path)
    read.add_argument("--spec", required=True, type=Path)
    args = parser.parse_args(argv)
    print(json.dumps(_read(args.store, json.loads(args.spec.read_text())), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
