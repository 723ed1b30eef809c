"""What every service shares (the stream worker, the evaluator, the CLI): the config error
that names its field, the Kafka connection and topics, and the heartbeat file.

A leaf: it imports nothing of probewire, so every package may import it. It lives in
``instrument`` because that package imports none of the others (the layering test), its
``__init__`` loads submodules lazily (importing this one loads no torch), the sink and the
stream already import ``instrument``'s torch-free wire contract, and the topics are part of
that contract. ``sinks`` would make the evaluators depend on the ClickHouse package that
only the stream may write through.

Config errors: the one error a component's config raises names the field, so the settings
tree can say where it sits (``stream.stage2.detectors.window: must be >= 3``).

Kafka: how the stream and the evaluators reach the cluster and the topics. Built once by the
composition root (``probewire.deploy.settings``) and handed to the components; the SASL
password is read from its environment variable, never stored.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigError",
    "Heartbeat",
    "KafkaConfig",
    "TopicConfig",
    "check",
    "default_heartbeat_path",
    "read_heartbeat",
    "within",
    "writer_alive",
]


# -- config errors ----------------------------------------------------------------------------
class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def check(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise ConfigError(field, message)


@contextmanager
def within(prefix: str) -> Iterator[None]:
    """Re-raise a ConfigError of a nested config with its field path under ``prefix``."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{prefix}.{exc.field}", exc.message) from None


# -- Kafka ------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class KafkaConfig:
    """How to reach the Kafka cluster (Tansu locally, an existing cluster in production)."""

    bootstrap: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password_env: str = "PROBEWIRE_KAFKA_SASL_PASSWORD"
    ssl_ca_location: str = ""

    def __post_init__(self) -> None:
        check(bool(self.bootstrap.strip()), "bootstrap", "must not be empty")
        protocols = {"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"}
        check(
            self.security_protocol in protocols,
            "security_protocol",
            f"must be one of {sorted(protocols)}, got {self.security_protocol!r}",
        )
        if self.security_protocol.startswith("SASL"):
            mechanisms = {"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"}
            check(
                self.sasl_mechanism in mechanisms,
                "sasl_mechanism",
                f"must be one of {sorted(mechanisms)} with SASL, got {self.sasl_mechanism!r}",
            )

    def sasl_password(self) -> str:
        """The SASL password, from the environment variable ``sasl_password_env``; a
        ConfigError naming the variable when it is unset or empty."""
        password = os.environ.get(self.sasl_password_env, "")
        check(
            bool(password),
            "kafka.sasl_password_env",
            f"SASL needs the password in the environment variable {self.sasl_password_env}",
        )
        return password

    def client_config(self) -> dict[str, str]:
        """librdkafka (confluent-kafka) settings; the SASL password is read from its env var."""
        config = {"bootstrap.servers": self.bootstrap, "security.protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            config["sasl.mechanism"] = self.sasl_mechanism
            config["sasl.username"] = self.sasl_username
            config["sasl.password"] = self.sasl_password()
        if self.ssl_ca_location:
            config["ssl.ca.location"] = self.ssl_ca_location
        return config


@dataclass(kw_only=True, slots=True)
class TopicConfig:
    """Topic names and their partition counts (created explicitly before use)."""

    metrics: str = "otlp_metrics"
    detail: str = "otlp_detail"
    """The ranks' scan-tier points and ring dumps, apart from the step tier that pages."""
    partials: str = "probewire.partials"
    """Rank blocks' partial states of a step (``stream.fanin``), keyed run:step."""
    steps: str = "probewire.steps"
    """Reduced steps, keyed by run: stage 2's ordered input (what the P0 view and pages need)."""
    detail_steps: str = "probewire.detail_steps"
    """Reduced detail, keyed run:step: per-rank values and tensor statistics of scan-tier
    steps, ring dumps and rank blocks, stored apart from the ordered per-run path."""
    control: str = "probewire.control"
    checkpoints: str = "probewire.checkpoints"
    evals: str = "probewire.evals"
    alerts: str = "probewire.alerts"
    deadletter: str = "probewire.deadletter"
    runs: str = "probewire.runs"
    """Run lifecycle events of the ranks (started with the run's config, finished, crashed)."""
    partitions: int = 4

    def __post_init__(self) -> None:
        check(self.partitions >= 1, "partitions", "must be >= 1")

    def all(self) -> dict[str, int]:
        """Every topic with its partition count; per-run topics use one partition per run key."""
        names = [
            self.metrics,
            self.detail,
            self.partials,
            self.steps,
            self.detail_steps,
            self.control,
            self.checkpoints,
            self.evals,
            self.alerts,
            self.deadletter,
            self.runs,
        ]
        return {name: self.partitions for name in names}


# -- heartbeat --------------------------------------------------------------------------------
def default_heartbeat_path(component: str) -> Path:
    base = os.environ.get(
        "PROBEWIRE_HEARTBEAT_DIR", os.path.join(tempfile.gettempdir(), "probewire")
    )
    return Path(base) / f"{component}.heartbeat"


@dataclass(slots=True)
class Heartbeat:
    """Writes ``{"component", "ts", "status", "runs": {run_id: {...}}, ...}`` atomically;
    ``extra`` (the worker's health verdict and reasons) is merged in."""

    path: Path
    component: str
    status: str = "starting"
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def beat(self, status: str | None = None, extra: dict[str, Any] | None = None) -> None:
        if status is not None:
            self.status = status
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "component": self.component,
            "ts": time.time(),
            "status": self.status,
            "pid": os.getpid(),
            "runs": self.runs,
            **(extra or {}),
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, default=str))
        os.replace(tmp, self.path)


def read_heartbeat(path: Path) -> dict[str, Any] | None:
    """The last heartbeat, or None when there is none (yet)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def writer_alive(pid: int) -> bool:
    """Whether process ``pid`` (the heartbeat's writer) still runs: not gone, not a zombie.
    A process of another user or namespace that answers counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: the signal answered
    return state not in ("Z", "X")
