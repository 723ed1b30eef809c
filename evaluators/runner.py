"""Score one checkpoint: load each weights stream through the model factory, run every
suite on it, and turn the scores into ``EvalRecord``s.

Weights streams: the checkpoint's own weights are labelled with the event's
``weights_stream`` (normally "raw"). When they are raw and the factory accepts a
keyword ``ema`` (``factory(path, ema=True)``), the running average is loaded too; the
factory returns None when the checkpoint carries none. Streams load one at a time, so
peak memory is one model.

Reference stream (``reference_stream``): "auto" (default) marks EMA when the checkpoint
carries it and the event's own stream otherwise; "raw" or "ema" always mark that
stream, and a checkpoint without it has no reference rows. "auto" is the right default
while every checkpoint of a run carries EMA (or none does); if EMA starts mid-run,
pin the stream explicitly so the reference does not switch during the run.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .lm import EvalModel, ProgressSink, Tokenizer, accepts_keyword, resolve_callable
from .records import CheckpointEvent, EvalRecord, EvaluationError, Versions
from .suites import Score, Suite

__all__ = [
    "CheckpointLoader",
    "EvaluationCancelled",
    "ReferenceStream",
    "SuiteFailure",
    "evaluate_checkpoint",
]

log = logging.getLogger(__name__)

ReferenceStream = Literal["auto", "raw", "ema"]


class EvaluationCancelled(Exception):
    """Raised from a progress tick when the service is stopping; nothing is published."""


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first sentence of the message`` on one line, at most ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    first = lines[0].split(". ", 1)[0] if lines else ""
    if len(first) > limit:
        first = first[: limit - 1] + "…"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _context_len(module: Any) -> int | None:
    """The context length a model states: ``context_len``, ``cfg.seq_len`` (the demo),
    or ``config.max_position_embeddings`` / ``config.n_positions`` (transformers)."""
    candidates = (
        getattr(module, "context_len", None),
        getattr(getattr(module, "cfg", None), "seq_len", None),
        getattr(getattr(module, "config", None), "max_position_embeddings", None),
        getattr(getattr(module, "config", None), "n_positions", None),
    )
    return next((int(c) for c in candidates if isinstance(c, int) and c > 1), None)


@dataclass(kw_only=True, slots=True)
class CheckpointLoader:
    """Loads checkpoints through a ``module:function`` factory (resolved once, here)."""

    factory: str
    tokenizer: Tokenizer
    context_len: int | None = None
    batch_size: int = 16
    device: str = "cpu"
    supports_ema: bool = field(init=False, default=False)
    _load: Callable[..., Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._load = resolve_callable(self.factory, "model factory")
        self.supports_ema = accepts_keyword(self._load, "ema")
        if self.context_len is not None and self.context_len < 2:
            raise EvaluationError(f"context_len must be >= 2, got {self.context_len}")

    def streams(self, event: CheckpointEvent) -> list[str]:
        """The weights streams to try for ``event``, its own first."""
        extra = ["ema"] if event.weights_stream == "raw" and self.supports_ema else []
        return [event.weights_stream, *extra]

    def load(self, event: CheckpointEvent, stream: str) -> EvalModel | None:
        """The model of ``stream``; None when an extra stream is absent from the checkpoint."""
        path = event.path
        if "://" not in path and not os.path.exists(path):
            raise EvaluationError(f"checkpoint not found: {path}")
        extra = stream != event.weights_stream
        try:
            module = self._load(path, ema=True) if extra else self._load(path)
        except FileNotFoundError:
            raise EvaluationError(f"checkpoint not found: {path}") from None
        except Exception as exc:  # a user-supplied factory: contain whatever it raises
            raise EvaluationError(
                f"cannot load checkpoint {path} ({stream} weights) with "
                f"{self.factory}: {_first_line(exc)}"
            ) from None
        if module is None:
            if extra:
                return None
            raise EvaluationError(f"model factory {self.factory} returned None for {path}")
        if not callable(module) and not hasattr(module, "predict_box"):
            raise EvaluationError(
                f"model factory {self.factory} returned a {type(module).__name__}, not a model"
            )
        if isinstance(module, torch.nn.Module):
            module = module.to(self.device).eval()
        return EvalModel(
            module=module,
            tokenizer=self.tokenizer,
            context_len=self.context_len or _context_len(module),
            batch_size=self.batch_size,
            device=self.device,
        )


@dataclass(frozen=True, slots=True)
class SuiteFailure:
    """A suite that failed on one stream; the other suites' records are still published."""

    suite: str
    weights_stream: str
    reason: str


class _Bar:
    """A suite's progress: a rich task plus the service's tick (heartbeat, cancellation)."""

    def __init__(self, progress: Progress, description: str, tick: Callable[[], None]) -> None:
        self.progress, self.tick = progress, tick
        self.task = progress.add_task(description, total=None)

    def set_total(self, total: int) -> None:
        self.progress.update(self.task, total=total)
        self.tick()

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)
        self.tick()


@contextmanager
def _progress(show: bool) -> Iterator[Progress]:
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=not show,
        transient=True,
    ) as progress:
        yield progress


def _reference(mode: ReferenceStream, own: str, scored: Sequence[str]) -> str | None:
    if mode == "auto":
        return "ema" if "ema" in scored else own
    return mode if mode in scored else None


def _finite(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def evaluate_checkpoint(
    event: CheckpointEvent,
    loader: CheckpointLoader,
    suites: Sequence[Suite],
    *,
    reference_stream: ReferenceStream = "auto",
    show_progress: bool = False,
    tick: Callable[[], None] = lambda: None,
) -> tuple[list[EvalRecord], list[SuiteFailure]]:
    """Records for every (stream, suite, metric), and the suites that failed.

    Raises ``EvaluationError`` when the checkpoint's own weights cannot be loaded and
    ``EvaluationCancelled`` when ``tick`` asks to stop.
    """
    if reference_stream not in ("auto", "raw", "ema"):
        raise EvaluationError(
            f"reference_stream must be auto, raw or ema, got {reference_stream!r}"
        )
    results: list[tuple[str, Suite, Versions, list[Score]]] = []
    failures: list[SuiteFailure] = []
    scored: list[str] = []
    with _progress(show_progress) as progress:
        for stream in loader.streams(event):
            try:
                model = loader.load(event, stream)
            except EvaluationError as exc:
                if stream == event.weights_stream:
                    raise
                failures.append(SuiteFailure(suite="*", weights_stream=stream, reason=str(exc)))
                continue
            if model is None:
                continue
            scored.append(stream)
            for suite in suites:
                bar: ProgressSink = _Bar(progress, f"step {event.step} {stream} {suite.name}", tick)
                outcome = _run_suite(event, stream, suite, model, bar)
                if isinstance(outcome, SuiteFailure):
                    failures.append(outcome)
                else:
                    results.append(outcome)
            del model
    reference = _reference(reference_stream, event.weights_stream, scored)
    return _records(event, results, reference), failures


def _run_suite(
    event: CheckpointEvent, stream: str, suite: Suite, model: Any, bar: ProgressSink
) -> tuple[str, Suite, Versions, list[Score]] | SuiteFailure:
    """One suite on one stream's weights: its scores, or the failure it is contained as
    (a cancellation still stops the evaluation)."""
    try:
        versions = suite.versions(model)
        return stream, suite, versions, suite.run(model, bar)
    except EvaluationCancelled:
        raise
    except Exception as exc:  # a suite or the user's model: contain it, go on
        log.warning(
            "suite %s on %s weights of %s step %d failed",
            suite.name,
            stream,
            event.run_id,
            event.step,
            exc_info=True,
        )
        return SuiteFailure(suite=suite.name, weights_stream=stream, reason=_first_line(exc))


def _records(
    event: CheckpointEvent,
    results: list[tuple[str, Suite, Versions, list[Score]]],
    reference: str | None,
) -> list[EvalRecord]:
    """One record per (stream, suite, metric); ``reference`` marks the reference stream's."""
    now = time.time_ns()
    return [
        EvalRecord(
            run_id=event.run_id,
            step=event.step,
            tokens=event.tokens,
            flops=event.flops,
            suite=suite.name,
            metric=score.metric,
            value=_finite(score.value),
            n_items=score.n_items,
            weights_stream=stream,
            reference=int(stream == reference),
            suite_version=v.suite,
            dataset_version=v.dataset,
            tokenizer_version=v.tokenizer,
            prompt_version=v.prompt,
            decoding_version=v.decoding,
            postprocess_version=v.postprocess,
            judge_version=v.judge,
            time_unix_nano=now,
        )
        for stream, suite, v, scores in results
        for score in scores
    ]
