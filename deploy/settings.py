"""One typed settings tree shared by the CLI, the stream worker, the evaluator and the chart.

Each component owns its config and its defaults (``stream.config.StreamConfig`` and the
configs it nests, ``instrument.plumbing.KafkaConfig`` / ``TopicConfig``); this module composes
them into one tree and adds the sections only the composition root needs.
Values come from, in increasing precedence: the defaults, a YAML/JSON file
(`PROBEWIRE_CONFIG` or an explicit path), and environment variables named
``PROBEWIRE_<SECTION>__<FIELD>``, nested fields joined by ``__`` (for example
``PROBEWIRE_STREAM__DEADLINE_S=20``, ``PROBEWIRE_STREAM__STAGE2__DETECTORS__WINDOW=50``).
Secrets are never fields: the settings name the environment variable that holds them,
so a ConfigMap can carry the whole tree and a Secret carries only the secret.
Every error names the offending field (``SettingsError: stream.deadline_s: ...``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml

from probewire.evaluators.config import EvaluatorConfig, EvaluatorSetup  # torch-free
from probewire.instrument.plumbing import ConfigError, KafkaConfig, TopicConfig, within
from probewire.stream.config import StreamConfig

__all__ = [
    "ClickHouseSettings",
    "EvaluatorSettings",
    "KafkaSettings",
    "Settings",
    "SettingsError",
    "StreamSettings",
    "TopicSettings",
    "load_settings",
    "split_credentials",
]

ENV_PREFIX = "PROBEWIRE_"

SettingsError = ConfigError  # every error names its field: "stream.deadline_s: must be > 0"
KafkaSettings = KafkaConfig
TopicSettings = TopicConfig
StreamSettings = StreamConfig
DEMO_CHECKPOINT_LOADER = "probewire.deploy.demo.model:load_checkpoint"
"""The evaluator's default ``model_factory``: the demo model's loader, named here, in the
composition root (``evaluators`` names no ``deploy`` module)."""


@dataclass(kw_only=True, slots=True)
class EvaluatorSettings(EvaluatorConfig):
    """``evaluator``: the evaluator's config with the composition root's default loader."""

    model_factory: str = DEMO_CHECKPOINT_LOADER


def split_credentials(url: str) -> tuple[str, str, str]:
    """``(url without user:password@, user, password)``: a password written into a URL is
    moved out before the URL is written anywhere (a settings file, a manifest, a log)."""
    parsed = urlsplit(url)
    if not parsed.password and not parsed.username:
        return url, "", ""
    host = parsed.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    netloc += f":{parsed.port}" if parsed.port else ""
    return (
        urlunsplit(parsed._replace(netloc=netloc)),
        unquote(parsed.username or ""),
        unquote(parsed.password or ""),
    )


def _check(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise SettingsError(path, message)


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
        _check(
            self.url.startswith(("chdb:///", "http://", "https://")),
            "url",
            "must start with chdb:///, http:// or https://, got "
            f"{split_credentials(self.url)[0]!r}",
        )
        _check(
            self.database.isidentifier(),
            "database",
            f"must be a plain identifier, got {self.database!r}",
        )
        _check(self.batch_rows > 0, "batch_rows", "must be > 0")
        _check(self.retry_max_s > 0, "retry_max_s", "must be > 0")
        _check(
            1 <= self.sensitive_ttl_days <= 90,
            "sensitive_ttl_days",
            "must lie in [1, 90]: sensitive artifacts are short-lived",
        )


@dataclass(kw_only=True, slots=True)
class Settings:
    """The root of the tree."""

    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    clickhouse: ClickHouseSettings = field(default_factory=ClickHouseSettings)
    topics: TopicConfig = field(default_factory=TopicConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    evaluator: EvaluatorSettings = field(default_factory=EvaluatorSettings)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def evaluator_setup(self) -> EvaluatorSetup:
        """What the evaluator service is built from (its consumer group defaults to
        ``<stream.app_id>.evaluator``)."""
        group_id = self.evaluator.group_id or f"{self.stream.app_id}.evaluator"
        return EvaluatorSetup(
            config=self.evaluator, kafka=self.kafka, topics=self.topics, group_id=group_id
        )


def _coerce(value: Any, kind: Any, path: str) -> Any:
    """Convert a file or environment value to the field's declared type."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        _check(
            text in {"1", "0", "true", "false", "yes", "no"},
            path,
            f"must be a boolean, got {value!r}",
        )
        return text in {"1", "true", "yes"}
    if kind in (int, float):
        try:
            number = kind(value)
        except (TypeError, ValueError):
            raise SettingsError(path, f"must be {kind.__name__}, got {value!r}") from None
        _check(not isinstance(value, bool), path, f"must be {kind.__name__}, got {value!r}")
        return number
    return str(value)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build_config(cls: type, raw: Mapping[str, Any], path: str) -> Any:
    """``cls`` from ``raw`` (nested mappings for nested configs); errors name the field."""
    _check(isinstance(raw, Mapping), path, f"must be a mapping, got {raw!r}")
    kinds = _field_types(cls)
    extra = sorted(set(raw) - set(kinds))
    _check(
        not extra, f"{path}.{extra[0]}" if extra else path, f"unknown field; known: {sorted(kinds)}"
    )
    kwargs = {}
    for name, value in raw.items():
        kind = kinds[name]
        kwargs[name] = (
            _build_config(kind, value or {}, f"{path}.{name}")
            if dataclasses.is_dataclass(kind)
            else _coerce(value, kind, f"{path}.{name}")
        )
    with within(path):
        return cls(**kwargs)


def _build(raw: Mapping[str, Mapping[str, Any]]) -> Settings:
    sections = _field_types(Settings)
    unknown = set(raw) - set(sections)
    _check(not unknown, ",".join(sorted(unknown)), f"unknown section; known: {sorted(sections)}")
    return Settings(
        **{
            section: _build_config(cls, raw.get(section) or {}, section)
            for section, cls in sections.items()
        }
    )


def _plain(value: Any) -> Any:
    """Mappings as dicts, all the way down (a file may hold None for an empty section)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def load_settings(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """Defaults <- file <- ``PROBEWIRE_<SECTION>__<FIELD>`` env vars <- explicit overrides."""
    env = os.environ if env is None else env
    raw: dict[str, dict[str, Any]] = {}
    path = path or env.get(f"{ENV_PREFIX}CONFIG")
    if path:
        file = Path(path)
        _check(file.is_file(), "config", f"file not found: {file}")
        try:
            loaded = (
                yaml.safe_load(file.read_text())
                if file.suffix in {".yaml", ".yml"}
                else json.loads(file.read_text())
            )
        except (yaml.YAMLError, json.JSONDecodeError) as exc:
            raise SettingsError("config", f"cannot parse {file}: {exc}") from None
        _check(isinstance(loaded, dict), "config", f"{file} must hold a mapping of sections")
        raw = {k: _plain(v or {}) for k, v in loaded.items()}
    for key, value in env.items():
        if key.startswith(ENV_PREFIX) and "__" in key:
            *parents, name = key[len(ENV_PREFIX) :].lower().split("__")
            node = raw
            for part in parents:
                child = node.setdefault(part, {})
                _check(isinstance(child, dict), ".".join(parents), f"set by {key} and a file")
                node = child
            node[name] = value
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    raw = {k: _plain(v) for k, v in raw.items()}
    return _build(raw)
