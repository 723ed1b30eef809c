"""probewire.evaluators: checkpoint scoring, off the training path (seeds 001 §10).

The service (``EvaluatorService``, command ``probewire evaluator``) consumes checkpoint
announcements (``CheckpointEvent``), decides with the token cadence (``Cadence``),
loads each weights stream through a model factory, runs suites and publishes one
``EvalRecord`` per metric. The pure score math lives in ``probewire.evaluators.scores``
and the JSONL data formats in ``probewire.evaluators.datasets``.

Names load on first use, so importing the package (or its torch-free modules
``records``, ``config``, ``cadence``, ``cli``) does not import torch: a training rank
announcing checkpoints and ``probewire health`` stay light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "DEFAULT_SUITES",
    "EXACT_MATCH",
    "FIRST_LINE",
    "SUITE_NAMES",
    "ByteTokenizer",
    "Cadence",
    "CadenceDecision",
    "CheckpointEvent",
    "CheckpointLoader",
    "ChoiceSuite",
    "EvalModel",
    "EvalRecord",
    "EvaluationError",
    "EvaluatorConfig",
    "EvaluatorOptions",
    "EvaluatorService",
    "EvaluatorSetup",
    "GenerationSuite",
    "GroundingSuite",
    "HeldoutSuite",
    "Judge",
    "MediaGain",
    "PassAtKSuite",
    "PostProcess",
    "ScalingReport",
    "Score",
    "SeededSampler",
    "Suite",
    "ThresholdBoxPredictor",
    "Tokenizer",
    "Versions",
    "add_evaluator_parser",
    "build_suites",
    "dataset_version",
    "ensure_demo_datasets",
    "evaluate_checkpoint",
    "make_grounding_set",
    "progress_mark",
    "render_image",
    "scaling_report",
]

_HOME = {
    **dict.fromkeys(["Cadence", "CadenceDecision", "progress_mark"], "cadence"),
    **dict.fromkeys(["add_evaluator_parser"], "cli"),
    **dict.fromkeys(["EvaluatorConfig", "EvaluatorSetup"], "config"),
    **dict.fromkeys(["build_suites", "ensure_demo_datasets"], "datadir"),
    **dict.fromkeys(["make_grounding_set", "render_image"], "images"),
    "ThresholdBoxPredictor": "testing",
    **dict.fromkeys(["ByteTokenizer", "EvalModel", "SeededSampler", "Tokenizer"], "lm"),
    **dict.fromkeys(
        [
            "DEFAULT_SUITES",
            "SUITE_NAMES",
            "CheckpointEvent",
            "EvalRecord",
            "EvaluationError",
            "Versions",
        ],
        "records",
    ),
    **dict.fromkeys(["CheckpointLoader", "evaluate_checkpoint"], "runner"),
    **dict.fromkeys(["ScalingReport", "scaling_report"], "scaling"),
    **dict.fromkeys(["EvaluatorOptions", "EvaluatorService"], "service"),
    **dict.fromkeys(
        [
            "EXACT_MATCH",
            "FIRST_LINE",
            "ChoiceSuite",
            "GenerationSuite",
            "GroundingSuite",
            "HeldoutSuite",
            "Judge",
            "MediaGain",
            "PassAtKSuite",
            "PostProcess",
            "Score",
            "Suite",
            "dataset_version",
        ],
        "suites",
    ),
}
assert set(_HOME) == set(__all__)


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .cadence import Cadence, CadenceDecision, progress_mark
    from .cli import add_evaluator_parser
    from .config import EvaluatorConfig, EvaluatorSetup
    from .datadir import build_suites, ensure_demo_datasets
    from .images import make_grounding_set, render_image
    from .lm import ByteTokenizer, EvalModel, SeededSampler, Tokenizer
    from .records import (
        DEFAULT_SUITES,
        SUITE_NAMES,
        CheckpointEvent,
        EvalRecord,
        EvaluationError,
        Versions,
    )
    from .runner import CheckpointLoader, evaluate_checkpoint
    from .scaling import ScalingReport, scaling_report
    from .service import EvaluatorOptions, EvaluatorService
    from .suites import (
        EXACT_MATCH,
        FIRST_LINE,
        ChoiceSuite,
        GenerationSuite,
        GroundingSuite,
        HeldoutSuite,
        Judge,
        MediaGain,
        PassAtKSuite,
        PostProcess,
        Score,
        Suite,
        dataset_version,
    )
    from .testing import ThresholdBoxPredictor
