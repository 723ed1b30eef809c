"""One typed settings tree shared by the CLI, the stream worker, the evaluator and the chart.

Values come from, in increasing precedence: the defaults below, a YAML/JSON file
(`PROBEWIRE_CONFIG` or an explicit path), and environment variables named
``PROBEWIRE_<SECTION>__<FIELD>`` (for example ``PROBEWIRE_STREAM__DEADLINE_S=20``).
Secrets are never fields: the settings name the environment variable that holds them,
so a ConfigMap can carry the whole tree and a Secret carries only the secret.
Every error names the offending field (``SettingsError: stream.deadline_s: ...``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from probewire.evaluators.records import DEFAULT_SUITES  # torch-free

__all__ = [
    "ClickHouseSettings",
    "EvaluatorSettings",
    "KafkaSettings",
    "Settings",
    "SettingsError",
    "StreamSettings",
    "TopicSettings",
    "load_settings",
]

ENV_PREFIX = "PROBEWIRE_"


class SettingsError(ValueError):
    """A configuration value is missing, of the wrong type, or out of range."""


def _check(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise SettingsError(f"{path}: {message}")


@dataclass(kw_only=True, slots=True)
class KafkaSettings:
    """How to reach the Kafka cluster (Tansu locally, an existing cluster in production)."""

    bootstrap: str = "127.0.0.1:9092"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str = ""
    sasl_username: str = ""
    sasl_password_env: str = "PROBEWIRE_KAFKA_SASL_PASSWORD"
    ssl_ca_location: str = ""

    def __post_init__(self) -> None:
        _check(bool(self.bootstrap.strip()), "kafka.bootstrap", "must not be empty")
        protocols = {"PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"}
        _check(self.security_protocol in protocols, "kafka.security_protocol",
               f"must be one of {sorted(protocols)}, got {self.security_protocol!r}")
        if self.security_protocol.startswith("SASL"):
            mechanisms = {"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"}
            _check(self.sasl_mechanism in mechanisms, "kafka.sasl_mechanism",
                   f"must be one of {sorted(mechanisms)} with SASL, got {self.sasl_mechanism!r}")

    def sasl_password(self) -> str:
        """The SASL password, from the environment variable ``sasl_password_env``; a
        SettingsError naming the variable when it is unset or empty."""
        password = os.environ.get(self.sasl_password_env, "")
        _check(bool(password), "kafka.sasl_password_env",
               f"SASL needs the password in the environment variable {self.sasl_password_env}")
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
class ClickHouseSettings:
    """The store: ``chdb:///abs/path`` (embedded, one process per directory) or ``http(s)://``."""

    url: str = "chdb:///" + str(Path("probewire-data").resolve()).lstrip("/")
    database: str = "probewire"
    username: str = "default"
    password_env: str = "PROBEWIRE_CLICKHOUSE_PASSWORD"
    batch_rows: int = 50_000
    retry_max_s: float = 30.0
    sensitive_artifacts: bool = False  # opt-in table for raw samples / token traces (short TTL)
    sensitive_ttl_days: int = 7

    def __post_init__(self) -> None:
        _check(self.url.startswith(("chdb:///", "http://", "https://")), "clickhouse.url",
               f"must start with chdb:///, http:// or https://, got {self.url!r}")
        _check(self.database.isidentifier(), "clickhouse.database",
               f"must be a plain identifier, got {self.database!r}")
        _check(self.batch_rows > 0, "clickhouse.batch_rows", "must be > 0")
        _check(self.retry_max_s > 0, "clickhouse.retry_max_s", "must be > 0")
        _check(1 <= self.sensitive_ttl_days <= 90, "clickhouse.sensitive_ttl_days",
               "must lie in [1, 90]: sensitive artifacts are short-lived")


@dataclass(kw_only=True, slots=True)
class TopicSettings:
    """Topic names and their partition counts (created explicitly before use)."""

    metrics: str = "otlp_metrics"
    steps: str = "probewire.steps"
    control: str = "probewire.control"
    checkpoints: str = "probewire.checkpoints"
    evals: str = "probewire.evals"
    alerts: str = "probewire.alerts"
    deadletter: str = "probewire.deadletter"
    partitions: int = 4

    def __post_init__(self) -> None:
        _check(self.partitions >= 1, "topics.partitions", "must be >= 1")

    def all(self) -> dict[str, int]:
        """Every topic with its partition count; per-run topics use one partition per run key."""
        names = [self.metrics, self.steps, self.control, self.checkpoints, self.evals,
                 self.alerts, self.deadletter]
        return {name: self.partitions for name in names}


@dataclass(kw_only=True, slots=True)
class StreamSettings:
    """The Faust worker: step completion, detectors, retention, alerting."""

    app_id: str = "probewire"
    deadline_s: float = 30.0
    detector_window: int = 100
    loss_z_threshold: float = 6.0
    grad_z_threshold: float = 6.0
    signal_z_threshold: float = 8.0
    straggler_ratio: float = 5.0   # step_time pages when one rank's own-time ratio S stays
    straggler_steps: int = 3       # at or over straggler_ratio for straggler_steps steps
    clip_threshold: float = 1.0
    clip_window: int = 100
    memory_growth: float = 0.2
    maxvio_threshold: float = 2.0
    maxvio_steps: int = 3
    media_scale_min: float = 0.1
    residual_ratio_min: float = 2.0 ** -8
    rearm_steps: int = 50
    run_idle_s: float = 120.0
    retention_every_k: int = 100
    retention_halo: int = 100
    warmup_steps: int = 100
    final_steps: int = 100
    alert_webhook_url: str = ""
    web_bind: str = "127.0.0.1"
    fetch_max_wait_ms: int = 50   # Tansu answers a waiting fetch only at its deadline
    batch_within_s: float = 0.25  # stage 2 writes the store at most this long after a step
    batch_steps: int = 500        # ... or once this many steps wait (alerts never wait)

    def __post_init__(self) -> None:
        _check(self.deadline_s > 0, "stream.deadline_s", "must be > 0")
        _check(self.detector_window >= 3, "stream.detector_window", "must be >= 3")
        for name in ("loss_z_threshold", "grad_z_threshold", "signal_z_threshold",
                     "clip_threshold", "memory_growth", "maxvio_threshold", "media_scale_min",
                     "residual_ratio_min", "run_idle_s"):
            _check(getattr(self, name) > 0, f"stream.{name}", "must be > 0")
        _check(1 <= self.fetch_max_wait_ms <= 5000, "stream.fetch_max_wait_ms",
               "must lie in [1, 5000]")
        _check(0 < self.batch_within_s <= 10, "stream.batch_within_s", "must lie in (0, 10]")
        _check(self.straggler_ratio > 1, "stream.straggler_ratio",
               "must be > 1 (S, a rank's own time over the others' median, is >= 1)")
        for name in ("clip_window", "retention_every_k", "rearm_steps", "maxvio_steps",
                     "batch_steps", "straggler_steps"):
            _check(getattr(self, name) >= 1, f"stream.{name}", "must be >= 1")
        for name in ("retention_halo", "warmup_steps", "final_steps"):
            _check(getattr(self, name) >= 0, f"stream.{name}", "must be >= 0")


@dataclass(kw_only=True, slots=True)
class EvaluatorSettings:
    """The checkpoint evaluator service."""

    enabled: bool = True
    model_factory: str = "probewire.deploy.demo.model:load_checkpoint"
    data_dir: str = ""
    every_fraction: float = 0.01
    suites: str = ",".join(DEFAULT_SUITES)
    """Comma-separated suites to run on each checkpoint (``probewire evaluator --help``)."""
    reference_stream: str = "auto"
    """Weights stream marked reference=1: auto (EMA when present), raw or ema."""
    group_id: str = ""
    """Consumer group of the evaluators; empty: ``<stream.app_id>.evaluator``."""
    tokenizer: str = "probewire.evaluators.lm:ByteTokenizer"
    """``module:callable`` returning the model's tokenizer."""
    context_len: int = 0
    """Model context in tokens; 0 reads it from the model."""
    batch_size: int = 16
    device: str = "cpu"

    def __post_init__(self) -> None:
        _check(self.reference_stream in ("auto", "raw", "ema"), "evaluator.reference_stream",
               f"must be auto, raw or ema, got {self.reference_stream!r}")
        _check(bool([s for s in self.suites.split(",") if s.strip()]), "evaluator.suites",
               "must name at least one suite")
        _check(":" in self.tokenizer, "evaluator.tokenizer",
               f"must look like 'module:callable', got {self.tokenizer!r}")
        _check(self.context_len >= 0, "evaluator.context_len", "must be >= 0 (0: from the model)")
        _check(self.batch_size >= 1, "evaluator.batch_size", "must be >= 1")
        _check(0.005 <= self.every_fraction <= 0.02, "evaluator.every_fraction",
               f"must lie in [0.005, 0.02] (0.5-2% of planned tokens), got {self.every_fraction}")
        _check(":" in self.model_factory, "evaluator.model_factory",
               f"must look like 'module:function', got {self.model_factory!r}")


@dataclass(kw_only=True, slots=True)
class Settings:
    """The root of the tree."""

    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    clickhouse: ClickHouseSettings = field(default_factory=ClickHouseSettings)
    topics: TopicSettings = field(default_factory=TopicSettings)
    stream: StreamSettings = field(default_factory=StreamSettings)
    evaluator: EvaluatorSettings = field(default_factory=EvaluatorSettings)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def _coerce(value: Any, kind: Any, path: str) -> Any:
    """Convert a file or environment value to the field's declared type."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        _check(text in {"1", "0", "true", "false", "yes", "no"}, path,
               f"must be a boolean, got {value!r}")
        return text in {"1", "true", "yes"}
    if kind in (int, float):
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise SettingsError(f"{path}: must be {kind.__name__}, got {value!r}") from None
        _check(not isinstance(value, bool), path, f"must be {kind.__name__}, got {value!r}")
        return number
    return str(value)


def _section_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(raw: Mapping[str, Mapping[str, Any]]) -> Settings:
    sections = _section_types(Settings)
    unknown = set(raw) - set(sections)
    _check(not unknown, ",".join(sorted(unknown)), f"unknown section; known: {sorted(sections)}")
    built: dict[str, Any] = {}
    for section, cls in sections.items():
        values = dict(raw.get(section) or {})
        kinds = _section_types(cls)
        extra = set(values) - set(kinds)
        _check(not extra, f"{section}.{sorted(extra)[0]}" if extra else section,
               f"unknown field; known: {sorted(kinds)}")
        kwargs = {k: _coerce(v, kinds[k], f"{section}.{k}") for k, v in values.items()}
        built[section] = cls(**kwargs)
    return Settings(**built)


def load_settings(path: str | os.PathLike[str] | None = None,
                  env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Settings:
    """Defaults <- file <- ``PROBEWIRE_<SECTION>__<FIELD>`` env vars <- explicit overrides."""
    env = os.environ if env is None else env
    raw: dict[str, dict[str, Any]] = {}
    path = path or env.get(f"{ENV_PREFIX}CONFIG")
    if path:
        file = Path(path)
        _check(file.is_file(), "config", f"file not found: {file}")
        try:
            loaded = yaml.safe_load(file.read_text()) if file.suffix in {".yaml", ".yml"} \
                else json.loads(file.read_text())
        except (yaml.YAMLError, json.JSONDecodeError) as exc:
            raise SettingsError(f"config: cannot parse {file}: {exc}") from None
        _check(isinstance(loaded, dict), "config", f"{file} must hold a mapping of sections")
        raw = {k: dict(v or {}) for k, v in loaded.items()}
    for key, value in env.items():
        if key.startswith(ENV_PREFIX) and "__" in key:
            section, _, name = key[len(ENV_PREFIX):].lower().partition("__")
            raw.setdefault(section, {})[name] = value
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    return _build(raw)

