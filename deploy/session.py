"""``probewire up`` and ``probewire run``: the local stack around a user's own training.

``up`` starts the broker, the stream worker (which owns the store and serves it read-only
on loopback) and, with ``--evaluator``, the checkpoint evaluator; prints the variables a
training script needs; shows a status line; and stops everything by PID on Ctrl-C.
``run`` does the same around one command (``torchrun --nproc-per-node 2 train.py``): the
command gets the variables in its environment, and at the end ``run`` prints the run's
pages and the exact ``report`` / ``explain`` commands. Inside a live ``up`` session on the
same store, ``run`` uses that session's broker instead of starting its own.

``attach`` with no transport reads these variables (``instrument.lifecycle``);
``RankIdentity.from_env`` reads the run id.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from probewire.deploy.health import read_heartbeat
from probewire.deploy.progress import StepProgress
from probewire.deploy.settings import Settings
from probewire.deploy.stack import LocalStack, StackError
from probewire.instrument.lifecycle import ATTEMPT_ENV

__all__ = [
    "SessionError",
    "StackSession",
    "run_command",
    "session_env",
    "start",
    "stop_session",
    "run_detail",
    "status_line",
    "stored_steps",
    "up",
    "wait_stored",
]

SESSION_FILE = "session.json"


class SessionError(Exception):
    """A mistake the user can fix; one line."""


@dataclass(slots=True)
class StackSession:
    """The stack a session uses: its own (``stack``), or that of a live ``up`` (``shared``)."""

    settings: Settings
    store: Path | None
    work_dir: Path
    bootstrap: str
    sql_url: str
    heartbeat: Path
    stack: LocalStack | None = None

    def env(self, run_id: str | None = None) -> dict[str, str]:
        return session_env(self.settings, self.bootstrap, run_id)


def session_env(settings: Settings, bootstrap: str, run_id: str | None = None) -> dict[str, str]:
    """The variables a training script needs (``attach`` and ``RankIdentity.from_env``)."""
    topics = settings.topics
    env = {
        "PROBEWIRE_KAFKA__BOOTSTRAP": bootstrap,
        "PROBEWIRE_TOPICS__METRICS": topics.metrics,
        "PROBEWIRE_TOPICS__DETAIL": topics.detail,
        "PROBEWIRE_TOPICS__CONTROL": topics.control,
        "PROBEWIRE_TOPICS__CHECKPOINTS": topics.checkpoints,
        "PROBEWIRE_TOPICS__RUNS": topics.runs,
    }
    if run_id:
        env["PROBEWIRE_RUN_ID"] = run_id
    return env


def record_crash(session: StackSession, run_id: str, attempt: str, reason: str) -> bool:
    """``probewire run`` says the run crashed when its command exited non-zero or was
    interrupted: a ``crashed`` event (``instrument.lifecycle``) of an attempt after the
    command's own (``<attempt>:launcher``), so it wins whatever the ranks said before it.
    Whether the broker took it within a few seconds."""
    from probewire.instrument.export import KafkaTransport
    from probewire.instrument.lifecycle import run_event
    from probewire.instrument.wire import RankIdentity

    identity = RankIdentity(run_id=run_id, rank=0, world_size=1)
    body = run_event(identity, "crashed", error=reason, attempt=f"{attempt}:launcher")
    transport = KafkaTransport(
        {"bootstrap.servers": session.bootstrap}, session.settings.topics.runs
    )
    try:
        transport.send(run_id.encode(), body)
        return transport.flush(5.0) == 0
    finally:
        transport.close()


def status_line(beat: dict[str, Any] | None) -> str:
    """``runs N · steps stored N · pages N`` from the worker's heartbeat (pure)."""
    if not beat:
        return "worker starting"
    runs = beat.get("runs") or {}
    steps = sum(int(r.get("steps_written", 0)) for r in runs.values())
    pages = sum(int(r.get("alerts", 0)) for r in runs.values())
    parts = [f"runs {len(runs)}", f"steps stored {steps}", f"pages {pages}"]
    live = [
        f"{run} {r.get('status', 'running')} at step {r.get('last_step', '-')}"
        for run, r in sorted(runs.items())
    ][-3:]
    if beat.get("healthy") is False:
        parts.append("worker UNHEALTHY: " + "; ".join(beat.get("reasons") or []))
    return " · ".join(parts + live)


def stored_steps(beat: dict[str, Any] | None, run_id: str) -> int:
    """The steps of ``run_id`` the worker stored, from its heartbeat (pure)."""
    return int(_run_progress(beat, run_id).get("steps_written", 0))


def run_detail(beat: dict[str, Any] | None, run_id: str) -> str:
    """The progress line's detail of ``run_id``: its status, latest step and pages, and a
    worker that is not healthy (pure)."""
    if not beat:
        return "worker starting"
    run = _run_progress(beat, run_id)
    parts = [f"{run.get('status', 'waiting for its first step')}"]
    if "last_step" in run:
        parts[0] += f" at step {run['last_step']}"
    parts.append(f"pages {int(run.get('alerts', 0))}")
    if beat.get("healthy") is False:
        parts.append("worker UNHEALTHY: " + "; ".join(beat.get("reasons") or []))
    return " · ".join(parts)


def _check_store(settings: Settings) -> Path | None:
    """The embedded store's directory (created), refused when another process holds it."""
    from probewire.deploy.reading import chdb_path
    from probewire.deploy.services import held_store

    path = chdb_path(settings.clickhouse.url)
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    held = held_store(settings)
    if held is not None:
        raise SessionError(held)
    return path


def _live_session(work_dir: Path) -> dict[str, Any] | None:
    try:
        info = json.loads((work_dir / SESSION_FILE).read_text())
        os.kill(int(info["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info


def _check_port(port: int) -> None:
    import socket

    if port:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                raise SessionError(
                    f"--sql-port {port} is in use on 127.0.0.1; pick another, or 0 for a free one"
                ) from None


def start(
    settings: Settings,
    work_dir: Path,
    *,
    evaluator: bool = False,
    sql_port: int = 0,
    reuse: bool = False,
) -> StackSession:
    """Start the stack (or, with ``reuse``, join a live ``up`` session of the same store)."""
    from probewire.deploy.reading import chdb_path

    work_dir.mkdir(parents=True, exist_ok=True)
    shared = _live_session(work_dir) if reuse else None
    if shared is not None:
        return StackSession(
            settings,
            chdb_path(settings.clickhouse.url),
            work_dir,
            shared["bootstrap"],
            shared.get("sql_url", ""),
            Path(shared["heartbeat"]),
        )
    store = _check_store(settings)
    _check_port(sql_port)
    settings = dataclasses.replace(
        settings,
        stream=dataclasses.replace(settings.stream, app_id=f"probewire-{uuid.uuid4().hex[:8]}"),
    )
    stack = LocalStack(settings, work_dir)
    try:
        stack.start_broker()
        stack.start_worker(sql_port=sql_port)
        if evaluator:
            stack.start_evaluator(work_dir / "evals-data")
    except BaseException:
        stack.stop()
        raise
    return StackSession(
        settings, store, work_dir, stack.bootstrap, stack.sql_url, stack.heartbeat_path, stack
    )


def _publish(session: StackSession) -> None:
    tmp = session.work_dir / (SESSION_FILE + ".tmp")
    tmp.write_text(
        json.dumps(
            {
                "pid": os.getpid(),
                "bootstrap": session.bootstrap,
                "sql_url": session.sql_url,
                "heartbeat": str(session.heartbeat),
                "store": str(session.store or ""),
            }
        )
    )
    os.replace(tmp, session.work_dir / SESSION_FILE)


def stop_session(session: StackSession) -> None:
    """Stop the stack this session started (a joined ``up`` session is left running)."""
    if session.stack is not None:
        (session.work_dir / SESSION_FILE).unlink(missing_ok=True)
        session.stack.stop()


def _banner(session: StackSession, out: TextIO, store_arg: str, run_id: str | None = None) -> None:
    print(
        f"probewire: broker {session.bootstrap} · store {session.store or session.settings.clickhouse.url}",
        file=out,
    )
    if session.sql_url:
        print(
            f"probewire: live SQL (ClickHouse HTTP, read-only) {session.sql_url}, its "
            "password the token in the store's 0600 probewire-reader.json · "
            f'`probewire sql {store_arg}"SELECT ..."` finds both by itself',
            file=out,
        )
    if run_id:
        print(
            "probewire: the command's environment (attach() with no transport reads it): "
            + " ".join(f"{k}={shlex.quote(v)}" for k, v in session.env(run_id).items()),
            file=out,
        )
        return
    print("probewire: a training script needs (attach() with no transport reads them):", file=out)
    for key, value in session.env().items():
        print(f"  export {key}={shlex.quote(value)}", file=out)
    print(
        "  export PROBEWIRE_RUN_ID=my-run   # or RankIdentity(run_id=...); torchrun's "
        "--rdzv-id also works",
        file=out,
    )


def _store_arg(session: StackSession) -> str:
    return f"--store {shlex.quote(str(session.store))} " if session.store else ""


def up(
    settings: Settings,
    work_dir: Path,
    *,
    evaluator: bool,
    sql_port: int,
    ui_port: int = 0,
    out: TextIO = sys.stdout,
    interval_s: float = 2.0,
    until: Callable[[], bool] = lambda: False,
) -> int:
    """``probewire up`` (see the module doc); returns when interrupted (or ``until()``).
    ``ui_port``: the web UI's loopback port (0: a free one, -1: no UI)."""
    session = start(settings, work_dir, evaluator=evaluator, sql_port=sql_port)
    try:
        _publish(session)
        _banner(session, out, _store_arg(session))
        if ui_port >= 0:
            url = session.stack.start_ui(ui_port)
            print(f"probewire: web UI {url} (`probewire ui` pages, live)", file=out, flush=True)
        print("probewire: running; Ctrl-C stops everything", file=out, flush=True)
        last = ""
        while not until():
            stack = session.stack
            for what, proc in (
                ("ui", stack.ui),
                ("worker", stack.worker),
                ("evaluator", stack.evaluator),
                ("broker", stack.broker),
            ):
                if proc is not None and proc.poll() is not None:
                    raise StackError(
                        f"{what} exited with code {proc.returncode}; see "
                        f"{work_dir / (what + '.log')}"
                    )
            line = status_line(read_heartbeat(session.heartbeat))
            if line != last:
                print(f"probewire: {line}", file=out, flush=True)
                last = line
            time.sleep(interval_s)
    finally:
        stop_session(session)
    return 0


def _resolve(command: list[str]) -> list[str]:
    if not command:
        raise SessionError(
            "no command: put it after --, e.g. probewire run -- torchrun "
            "--nproc-per-node 2 train.py"
        )
    if shutil.which(command[0]) is None:
        raise SessionError(f"command not found: {command[0]}")
    return command


def _child_setup() -> None:
    """The user's command stays in the terminal's process group (Ctrl-C reaches it) and
    gets SIGTERM when ``probewire run`` dies."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_progress(beat: dict[str, Any] | None, run_id: str) -> dict[str, Any]:
    return ((beat or {}).get("runs") or {}).get(run_id) or {}


def wait_stored(
    session: StackSession,
    run_ids: list[str],
    settle_s: float = 3.0,
    quiet_s: float = 10.0,
    timeout_s: float = 120.0,
) -> None:
    """The runs' last steps are still on their way through the stream: wait until their
    stored step counts have not moved for ``settle_s`` (bounded by ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    steps, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        beat = read_heartbeat(session.heartbeat)
        progress = [_run_progress(beat, run_id) for run_id in run_ids]
        stored = sum(int(p.get("steps_written", 0)) for p in progress)
        if stored != steps:
            steps, since = stored, time.monotonic()
        # runs that said they ended settle fast; one that did not (no close(), or no
        # probewire in the command at all) once nothing has arrived for quiet_s
        ended = all(p.get("status") in ("finished", "crashed") for p in progress)
        if time.monotonic() - since >= (settle_s if ended else quiet_s):
            return
        time.sleep(0.25)


def run_command(
    settings: Settings,
    work_dir: Path,
    command: list[str],
    *,
    run_id: str | None,
    evaluator: bool,
    sql_port: int,
    out: TextIO = sys.stderr,
    settle_s: float = 3.0,
    quiet_s: float = 10.0,
    drain_timeout_s: float = 120.0,
    report: Callable[[str], None] = lambda run_id: None,
) -> int:
    """``probewire run``: the command's exit code. Once every step of the run is stored,
    ``report(run_id)`` runs while the worker still serves the store; then the stack stops."""
    command = _resolve(command)
    run_id = run_id or f"run-{uuid.uuid4().hex[:8]}"
    if ":" in run_id:
        raise SessionError(f"--run-id must not contain ':', got {run_id!r}")
    session = start(settings, work_dir, evaluator=evaluator, sql_port=sql_port, reuse=True)
    proc: subprocess.Popen | None = None
    attempt = f"probewire-run:{uuid.uuid4().hex[:12]}"
    try:
        _banner(session, out, _store_arg(session), run_id)
        print(f"probewire: run {run_id}: {shlex.join(command)}", file=out, flush=True)
        proc = subprocess.Popen(
            command,
            env={**os.environ, **session.env(run_id), ATTEMPT_ENV: attempt},
            preexec_fn=_child_setup,
        )
        if session.stack is not None:
            session.stack.record("command", proc)
        with StepProgress(f"run {run_id}", out=out) as progress:
            while proc.poll() is None:
                if session.stack is not None and session.stack.worker.poll() is not None:
                    raise StackError(
                        f"worker exited with code {session.stack.worker.returncode}; "
                        f"see {work_dir / 'worker.log'}"
                    )
                beat = read_heartbeat(session.heartbeat)
                progress.update(stored_steps(beat, run_id), run_detail(beat, run_id))
                time.sleep(0.2)
        code = proc.returncode
        if code != 0:
            record_crash(session, run_id, attempt, f"the command exited with code {code}")
        wait_stored(session, [run_id], settle_s, quiet_s, drain_timeout_s)
        print(f"probewire: {status_line(read_heartbeat(session.heartbeat))}", file=out)
        report(run_id)
    except KeyboardInterrupt:
        if proc is not None:  # Ctrl-C: the command got it too (same process group)
            record_crash(session, run_id, attempt, "interrupted (Ctrl-C)")
        raise
    finally:
        if proc is not None:
            stop_process_group = proc.poll() is None
            if stop_process_group:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        stop_session(session)
    return code
