"""The evaluator's configuration (``evaluator`` in the settings tree) and what the
composition root hands the service: its config, the Kafka connection, the topics and the
consumer group. Torch-free, like ``records``: ``probewire.deploy.settings`` imports it."""

from __future__ import annotations

from dataclasses import dataclass, field

from probewire.instrument.plumbing import KafkaConfig, TopicConfig, check

from .records import DEFAULT_SUITES

__all__ = ["EvaluatorConfig", "EvaluatorSetup"]


@dataclass(kw_only=True, slots=True)
class EvaluatorConfig:
    """The checkpoint evaluator service."""

    enabled: bool = True
    model_factory: str
    """``module:function`` loading a checkpoint (``load(path)``, or ``load(path, ema=...)``);
    no default here: the composition root supplies one (``probewire.deploy.settings``: the
    demo model's)."""
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
        check(
            self.reference_stream in ("auto", "raw", "ema"),
            "reference_stream",
            f"must be auto, raw or ema, got {self.reference_stream!r}",
        )
        check(
            bool([s for s in self.suites.split(",") if s.strip()]),
            "suites",
            "must name at least one suite",
        )
        check(
            ":" in self.tokenizer,
            "tokenizer",
            f"must look like 'module:callable', got {self.tokenizer!r}",
        )
        check(self.context_len >= 0, "context_len", "must be >= 0 (0: from the model)")
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(
            0.005 <= self.every_fraction <= 0.02,
            "every_fraction",
            f"must lie in [0.005, 0.02] (0.5-2% of planned tokens), got {self.every_fraction}",
        )
        check(
            ":" in self.model_factory,
            "model_factory",
            f"must look like 'module:function', got {self.model_factory!r}",
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class EvaluatorSetup:
    """Built configs for ``EvaluatorService``: the composition root (``deploy``) makes it
    from the settings tree; ``group_id`` is the consumer group when no flag names one."""

    config: EvaluatorConfig
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    topics: TopicConfig = field(default_factory=TopicConfig)
    group_id: str = "probewire.evaluator"
