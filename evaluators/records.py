"""Wire records of the evaluator: checkpoint announcements in, eval results out.

Both are JSON objects on Kafka, keyed by ``run_id``. This module is torch-free so a
training rank can build announcements without importing the suites.

``probewire.checkpoints`` (in)::

    {"run_id": str, "step": int, "tokens": int, "flops": number, "path": str,
     "weights_stream": "raw" | "ema",   # optional, default "raw"
     "key": bool,                       # optional, default false
     "planned_tokens": int}             # optional; needed for the token cadence

``probewire.evals`` (out): one ``EvalRecord`` per metric, fields as in its docstring.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DEFAULT_SUITES",
    "SUITE_NAMES",
    "WEIGHT_STREAMS",
    "CheckpointEvent",
    "EvalRecord",
    "EvaluationError",
    "Versions",
    "WeightsStream",
]

WeightsStream = Literal["raw", "ema"]
WEIGHT_STREAMS: tuple[str, ...] = ("raw", "ema")
# values of EvalRecord.suite for the built-in suites (``datadir.build_suites``)
SUITE_NAMES = ("heldout", "choice", "generation", "pass_at_k", "grounding", "grounding_media")
DEFAULT_SUITES = ("heldout", "choice", "generation")


class EvaluationError(Exception):
    """An evaluation that cannot run; the message is one line that says what and where."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def _int_field(obj: dict[str, Any], name: str, *, minimum: int) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise EvaluationError(
            f"checkpoint event: '{name}' must be an integer >= {minimum}, got {value!r}"
        )
    return value


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointEvent:
    """One checkpoint announced by rank 0 (see the module docstring for the JSON)."""

    run_id: str
    step: int
    tokens: int
    flops: float
    path: str
    weights_stream: WeightsStream = "raw"
    key: bool = False
    planned_tokens: int | None = None

    @classmethod
    def from_json(cls, payload: bytes | str) -> CheckpointEvent:
        """Parse and validate; raise ``EvaluationError`` naming the bad field."""
        try:
            obj = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EvaluationError(f"checkpoint event: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise EvaluationError("checkpoint event: expected a JSON object")
        run_id = obj.get("run_id")
        if not isinstance(run_id, str) or not run_id:
            raise EvaluationError(
                f"checkpoint event: 'run_id' must be a non-empty string, got {run_id!r}"
            )
        path = obj.get("path")
        if not isinstance(path, str) or not path:
            raise EvaluationError(
                f"checkpoint event: 'path' must be a non-empty string, got {path!r}"
            )
        flops = obj.get("flops")
        if (
            not isinstance(flops, int | float)
            or isinstance(flops, bool)
            or not math.isfinite(flops)
            or flops < 0
        ):
            raise EvaluationError(f"checkpoint event: 'flops' must be a number >= 0, got {flops!r}")
        stream = obj.get("weights_stream", "raw")
        if stream not in WEIGHT_STREAMS:
            raise EvaluationError(
                f"checkpoint event: 'weights_stream' must be one of "
                f"{WEIGHT_STREAMS}, got {stream!r}"
            )
        key = obj.get("key", False)
        if not isinstance(key, bool):
            raise EvaluationError(f"checkpoint event: 'key' must be a boolean, got {key!r}")
        planned = obj.get("planned_tokens")
        if planned is not None:
            planned = _int_field(obj, "planned_tokens", minimum=1)
        return cls(
            run_id=run_id,
            step=_int_field(obj, "step", minimum=0),
            tokens=_int_field(obj, "tokens", minimum=0),
            flops=float(flops),
            path=path,
            weights_stream=stream,
            key=key,
            planned_tokens=planned,
        )

    def to_json(self) -> bytes:
        body = dataclasses.asdict(self)
        if self.planned_tokens is None:
            del body["planned_tokens"]
        return json.dumps(body).encode()


@dataclass(kw_only=True, slots=True, frozen=True)
class Versions:
    """What a score's definition depends on; a change in any of them is a new metric.

    ``suite`` is the suite's own version (for choice accuracy it carries the option
    normalisation), ``dataset`` a content hash of the items, ``tokenizer`` the
    tokenizer's version string, ``prompt`` the prompt template, ``decoding`` the
    scoring or decoding parameters (context window, temperature, samples, seed),
    ``postprocess`` the answer clean-up and ``judge`` the scoring rule. "none" marks a
    part a suite does not have.
    """

    suite: str
    dataset: str
    tokenizer: str
    prompt: str
    decoding: str
    postprocess: str = "none"
    judge: str = "none"


@dataclass(kw_only=True, slots=True, frozen=True)
class EvalRecord:
    """One metric of one suite on one weights stream of one checkpoint.

    ``value`` is None when the metric is not finite (a perplexity that overflows);
    ``reference`` is 1 on the stream chosen for decisions and 0 otherwise;
    ``n_items`` counts the suite's items (documents, questions, problems, images).
    """

    run_id: str
    step: int
    tokens: int
    flops: float
    suite: str
    metric: str
    value: float | None
    n_items: int
    weights_stream: str
    reference: int
    suite_version: str
    dataset_version: str
    tokenizer_version: str
    prompt_version: str
    decoding_version: str
    postprocess_version: str
    judge_version: str
    time_unix_nano: int

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), allow_nan=False).encode()

    @classmethod
    def from_json(cls, payload: bytes | str) -> EvalRecord:
        return cls(**json.loads(payload))
