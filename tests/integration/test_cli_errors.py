"""Every user mistake around `worker`, `evaluator`, `up` and `run` is one line on stderr
with the fix, a non-zero exit code and nothing left running; on a fresh machine the
services create what they need."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.integration


def cli(
    *args: str, env: dict | None = None, timeout: float = 120, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "probewire.deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def one_line(out: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1, out.stderr
    for needle in needles:
        assert needle in out.stderr, out.stderr


def no_children_left(before: set[int]) -> None:
    """No process this test started is still alive (our own children only)."""
    alive = [
        p
        for p in psutil.Process().children(recursive=True)
        if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert not alive, alive


@pytest.fixture()
def children() -> set[int]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield before
    no_children_left(before)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def silent_port():
    """A loopback port that accepts connections and never answers (not Kafka)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.parametrize("service", ["worker", "evaluator"])
def test_no_broker_is_one_line_at_once(service, scratch_dir, children):
    started = time.monotonic()
    out = cli(
        service,
        env={
            "PROBEWIRE_KAFKA__BOOTSTRAP": f"127.0.0.1:{free_port()}",
            "PROBEWIRE_HEARTBEAT_DIR": str(scratch_dir / "hb"),
        },
    )
    one_line(out, 2, "no Kafka broker at 127.0.0.1:", "probewire up")
    assert time.monotonic() - started < 30


def test_a_port_that_is_not_kafka_is_one_line_after_a_bounded_wait(
    silent_port, scratch_dir, children
):
    started = time.monotonic()
    out = cli(
        "worker",
        env={
            "PROBEWIRE_KAFKA__BOOTSTRAP": f"127.0.0.1:{silent_port}",
            "PROBEWIRE_HEARTBEAT_DIR": str(scratch_dir / "hb"),
        },
    )
    one_line(out, 2, f"127.0.0.1:{silent_port} did not answer as a Kafka broker within 8s")
    assert time.monotonic() - started < 40


def test_worker_on_a_fresh_machine_creates_what_it_needs(kafka_bootstrap, scratch_dir, children):
    """No heartbeat directory, no store directory, no topics of its own names: it creates
    them, becomes ready, and stops on SIGTERM."""
    tag = os.urandom(4).hex()
    env = {
        "PROBEWIRE_KAFKA__BOOTSTRAP": kafka_bootstrap,
        "PROBEWIRE_HEARTBEAT_DIR": str(scratch_dir / "fresh" / "hb"),
        "PROBEWIRE_CLICKHOUSE__URL": "chdb:///" + str(scratch_dir / "fresh" / "store")[1:],
        "PROBEWIRE_STREAM__APP_ID": f"pw-fresh-{tag}",
        **{
            f"PROBEWIRE_TOPICS__{k.upper()}": f"{k}-{tag}"
            for k in (
                "metrics",
                "steps",
                "control",
                "checkpoints",
                "evals",
                "alerts",
                "deadletter",
                "runs",
            )
        },
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "probewire.deploy.cli", "worker", "--sql-port", "-1"],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        beat = scratch_dir / "fresh" / "hb" / "worker.heartbeat"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if beat.exists() and json.loads(beat.read_text()).get("status") == "ready":
                break
            time.sleep(0.3)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert json.loads(beat.read_text())["status"] == "ready"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_run_without_a_command_or_with_an_unknown_one(scratch_dir, children):
    store = str(scratch_dir / "store")
    one_line(cli("run", "--store", store), 2, "no command: put it after --")
    one_line(
        cli("run", "--store", store, "--", "no-such-command-x"),
        2,
        "command not found: no-such-command-x",
    )
    one_line(
        cli("run", "--store", store, "--run-id", "a:b", "--", "true"),
        2,
        "--run-id must not contain ':'",
    )
    assert not (scratch_dir / ".probewire-store" / "processes.json").exists()


def test_a_store_held_by_another_process_or_a_busy_port(scratch_dir, children):
    store = scratch_dir / "store"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
        import time
        from probewire.sinks.clickhouse import connect
        client = connect("chdb:///{str(store)[1:]}")  # held while referenced
        client.command("SELECT 1")
        print("ready", flush=True)
        time.sleep(120)"""),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        for command in ("run", "up"):
            extra = ["--", "true"] if command == "run" else []
            one_line(
                cli(command, "--store", str(store), *extra),
                2,
                f"the store {store} is held by pid {holder.pid} ",
                "--store DIR",
            )
    finally:
        holder.kill()
        holder.wait(10)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        one_line(
            cli("up", "--store", str(scratch_dir / "s2"), "--sql-port", str(port)),
            2,
            f"--sql-port {port} is in use",
        )
    assert not (scratch_dir / ".probewire-s2" / "processes.json").exists()


def test_demo_and_worker_on_a_held_store_are_one_line_within_2_s(scratch_dir, children):
    """``demo`` waited 90 s for its worker, ``worker`` retried forever: both now name the
    holder's PID in one line and exit 2, spending at most 2 s of CPU more than a command
    that exits at once (CPU, not wall time: this machine is shared; the wall time is
    bounded too, far below the old 90 s)."""
    store = scratch_dir / "store"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(url="chdb:///" + str(store)[1:])],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        startup, _ = timed("health", "--component", "worker", "--heartbeat", str(store / "x"))
        env = {"PROBEWIRE_CLICKHOUSE__URL": "chdb:///" + str(store)[1:]}
        for argv, extra in ((("demo", "--store", str(store)), {}), (("worker",), env)):
            (cpu, wall), out = timed(*argv, env=extra, cwd=scratch_dir)
            one_line(out, 2, f"the store {store} is held by pid {holder.pid} ")
            assert cpu <= startup[0] + 2.0 and wall <= 20.0, (argv, cpu, wall, startup)
    finally:
        holder.kill()
        holder.wait(10)


def timed(*args: str, **kw) -> tuple[tuple[float, float], subprocess.CompletedProcess]:
    """((CPU seconds, wall seconds), result) of one ``probewire`` command."""
    import resource

    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    out = cli(*args, **kw)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return (cpu, time.monotonic() - started), out


HOLD = textwrap.dedent("""
    import time
    from probewire.sinks.clickhouse import connect
    client = connect("{url}")  # held while referenced
    client.command("SELECT 1")
    print("ready", flush=True)
    time.sleep(120)""")


CRASHING = textwrap.dedent("""
    import torch
    from probewire.instrument import attach
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = attach(model, opt, run_config={"lr": 0.1})
    try:
        for step in range(100):
            with monitor.step(step):
                model(torch.randn(2, 4)).sum().backward()
                opt.step(); opt.zero_grad()
                if step == 3:
                    raise RuntimeError("diverged")
    finally:
        monitor.close()
""")


def test_a_failing_command_keeps_its_exit_code_and_the_run_is_crashed(scratch_dir, children):
    script = scratch_dir / "crash.py"
    script.write_text(CRASHING)
    store = scratch_dir / "store"
    out = cli(
        "run",
        "--store",
        str(store),
        "--run-id",
        "c1",
        "--",
        sys.executable,
        str(script),
        timeout=300,
    )
    assert out.returncode == 1
    assert "the command exited with code 1" in out.stderr
    # steps 0-2 are stored; step 3 raised, so it emitted nothing and marked the run crashed
    assert "run c1: crashed, 3 steps stored" in out.stdout, out.stdout + out.stderr[-2000:]
    started = json.loads((scratch_dir / ".probewire-store" / "processes.json").read_text())
    assert {p["what"] for p in started} == {"broker", "worker", "command"}
    assert not [
        p
        for p in started
        if psutil.pid_exists(p["pid"]) and psutil.Process(p["pid"]).status() != psutil.STATUS_ZOMBIE
    ]


def test_sql_piped_into_head_stops_quietly(scratch_dir, children):
    """``probewire sql ... | head -1``: head closes the pipe after one line; the command
    stops with no traceback and no BrokenPipeError on stderr."""
    store = scratch_dir / "store"
    assert cli("migrate", "--store", str(store)).returncode == 0
    cmd = (
        f"{sys.executable} -m probewire.deploy.cli sql --store {store} --format csv "
        "'SELECT number FROM numbers(300000)' | head -1"
    )
    out = subprocess.run(
        ["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() in ("number", "0"), out.stdout[:200]
    assert out.stderr == "", out.stderr


def test_ui_on_a_missing_store_or_a_busy_port_is_one_line(scratch_dir, children):
    one_line(cli("ui", "--store", str(scratch_dir / "nothing")), 2, "no store at", "--store")
    store = scratch_dir / "s-ui"
    migrated = cli("migrate", "--store", str(store))
    assert migrated.returncode == 0, migrated.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        one_line(
            cli("ui", "--store", str(store), "--port", str(port)),
            2,
            f"cannot serve on 127.0.0.1:{port}",
        )
