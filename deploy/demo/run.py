"""``probewire demo``: the whole pipeline on one machine, from training ranks to ClickHouse.

Broker and worker start, N data-parallel ranks train the tiny model and emit, the
worker reduces and stores, then everything stops (by PID) and the last steps are read
back from the store with SQL.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from probewire.deploy.progress import StepProgress
from probewire.deploy.settings import Settings
from probewire.deploy.stack import LocalStack, StackError, free_port, spawn, stop_process

__all__ = ["DemoResult", "run_demo", "train_run"]


@dataclass(slots=True, kw_only=True)
class DemoResult:
    run_id: str
    steps_written: int
    wall_s: float


def _start_ranks(
    stack: LocalStack,
    run_id: str,
    ranks: int,
    steps: int,
    trace: Path | None,
    extra_args: list[str],
) -> list[subprocess.Popen]:
    port = free_port()
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # run lifecycle events: attach reads it
        "PROBEWIRE_TOPICS__RUNS": stack.settings.topics.runs,
    }
    procs = []
    for rank in range(ranks):
        cmd = [
            sys.executable,
            "-m",
            "probewire.deploy.demo.train",
            "--rank",
            str(rank),
            "--world-size",
            str(ranks),
            "--master-port",
            str(port),
            "--run-id",
            run_id,
            "--steps",
            str(steps),
            "--bootstrap",
            stack.bootstrap,
            "--topic",
            stack.settings.topics.metrics,
            "--detail-topic",
            stack.settings.topics.detail,
            *extra_args,
        ]
        if trace is not None:
            cmd += ["--trace", str(trace)]
        log = open(stack.work_dir / f"rank{rank}.log", "ab")
        stack.logs.append(log)
        proc = spawn(cmd, log, env)
        stack.record(f"rank{rank}", proc, port if rank == 0 else None)
        procs.append(proc)
    return procs


def _wait_evaluations(stack: LocalStack, run_id: str, checkpoints: int, deadline: float) -> None:
    """Until the evaluator finished every checkpoint and the worker stored its records."""
    stable_since, last = time.monotonic(), -1
    while time.monotonic() < deadline:
        written = stack.progress(run_id, "evals_written")
        if written != last:
            stable_since, last = time.monotonic(), written
        if (
            stack.checkpoints_done(run_id) >= checkpoints
            and written
            and time.monotonic() - stable_since > 2.0
        ):
            return
        time.sleep(0.25)
    raise StackError(f"evaluations of {run_id} not stored in time; see evaluator.log")


def train_run(
    stack: LocalStack,
    *,
    run_id: str,
    ranks: int,
    steps: int,
    trace: Path | None = None,
    extra_train_args: list[str] | None = None,
    show_progress: bool = False,
    timeout_s: float = 600.0,
) -> DemoResult:
    """Train one run on a started stack (broker and worker up) until the worker has stored
    all its steps; the ranks are stopped by PID whatever happens. Several runs can go
    through one stack, one after another, each with its own run id."""
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    procs: list[subprocess.Popen] = []
    try:
        procs = _start_ranks(stack, run_id, ranks, steps, trace, list(extra_train_args or []))
        with StepProgress(f"run {run_id}", steps, enabled=show_progress) as progress:
            deadline = time.monotonic() + timeout_s
            while (written := stack.progress(run_id)) < steps:
                progress.update(written)
                failed = [p for p in procs if p.poll() not in (None, 0)]
                if failed:
                    raise StackError(
                        f"a training rank exited with code "
                        f"{failed[0].returncode}; see {stack.work_dir}/rank*.log"
                    )
                if time.monotonic() > deadline:
                    raise StackError(
                        f"only {written}/{steps} steps stored after "
                        f"{timeout_s:.0f}s; see {stack.work_dir}/worker.log"
                    )
                time.sleep(0.25)
            progress.update(written)
        for proc in procs:
            proc.wait(60)
    finally:
        for proc in procs:
            stop_process(proc)
    return DemoResult(run_id=run_id, steps_written=written, wall_s=time.monotonic() - started)


def run_demo(
    settings: Settings,
    *,
    ranks: int,
    steps: int,
    work_dir: Path,
    run_id: str | None = None,
    trace: Path | None = None,
    extra_train_args: list[str] | None = None,
    show_progress: bool = True,
    timeout_s: float = 600.0,
    bootstrap: str | None = None,
    evaluate_every: int = 0,
) -> DemoResult:
    """Run the demo end to end; the store is closed again when this returns.

    ``bootstrap`` names an existing Kafka cluster; by default a local Tansu broker is started.
    ``evaluate_every`` > 0 saves a checkpoint every that many steps and runs the evaluator
    service on them; the run returns once their evaluations are stored.
    """
    run_id = run_id or f"demo-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    settings = dataclasses.replace(
        settings,
        stream=dataclasses.replace(settings.stream, app_id=f"probewire-{uuid.uuid4().hex[:8]}"),
    )
    with LocalStack(settings, work_dir) as stack:
        if bootstrap:
            stack.use_broker(bootstrap)
        else:
            stack.start_broker()
        stack.start_worker()
        extra = list(extra_train_args or [])
        if evaluate_every:
            stack.start_evaluator(work_dir / "evals-data")
            extra += [
                "--save-every",
                str(evaluate_every),
                "--ckpt-dir",
                str(work_dir / "checkpoints" / run_id),
            ]
        deadline = time.monotonic() + timeout_s
        result = train_run(
            stack,
            run_id=run_id,
            ranks=ranks,
            steps=steps,
            trace=trace,
            extra_train_args=extra,
            show_progress=show_progress,
            timeout_s=timeout_s,
        )
        if evaluate_every:
            _wait_evaluations(stack, run_id, steps // evaluate_every, deadline)
    return DemoResult(
        run_id=run_id, steps_written=result.steps_written, wall_s=time.monotonic() - started
    )
