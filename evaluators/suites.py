"""Evaluation suites (seeds 001 §10): a suite runs one model on one data set and returns
scores; the math is in ``scores.py``, the model calls in ``lm.py``.

| suite         | metrics                          | items                 |
|---------------|----------------------------------|-----------------------|
| heldout       | nll, ppl (lower), bpb (lower)    | ``HeldoutDoc``        |
| choice        | accuracy                         | ``ChoiceItem``        |
| generation    | the judge's name (exact_match)   | ``GenerationItem``    |
| pass_at_k     | pass@k for each k                | ``GenerationItem``    |
| grounding     | iou                              | ``GroundingItem``     |
| <inner>_media | m_with_media, m_without_media, m_media_gain for each higher-is-better m |

Every suite states its ``Versions``: change a prompt, a normalisation, a decoding
parameter, a post-processing step or a judge, and the version strings change with it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from .datasets import ChoiceItem, GenerationItem, GroundingItem, HeldoutDoc
from .images import IMAGE_VERSION, render_image
from .lm import (
    NO_PROGRESS,
    EvalModel,
    ProgressSink,
    Sampler,
    SeededSampler,
    continuation_nlls,
    generate,
)
from .records import EvaluationError, Versions
from .scores import (
    Normalization,
    bits_per_byte,
    choice_accuracy,
    choice_suite_version,
    exact_match,
    iou,
    media_gain,
    nll_and_ppl,
    pass_at_k,
    utf8_byte_count,
)

__all__ = [
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
]


@dataclass(kw_only=True, slots=True, frozen=True)
class Score:
    """One metric a suite measured, over ``n_items`` items."""

    metric: str
    value: float
    n_items: int
    higher_is_better: bool


class Suite(Protocol):
    """A suite: a name, whether any metric is higher-is-better, versions, and a run."""

    name: str
    higher_is_better: bool

    def versions(self, model: EvalModel) -> Versions: ...

    def run(self, model: EvalModel, progress: ProgressSink = ...) -> list[Score]: ...


def dataset_version(items: Sequence[Any]) -> str:
    """Content hash of a data set: sha256 over its records as canonical JSON lines."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(json.dumps(asdict(item), sort_keys=True, ensure_ascii=False).encode())
        digest.update(b"\n")
    return "sha256:" + digest.hexdigest()[:16]


def _non_empty(name: str, items: Sequence[Any]) -> tuple[Any, ...]:
    if len(items) == 0:
        raise EvaluationError(f"suite {name}: empty dataset, nothing to score")
    return tuple(items)


def _likelihood_decoding(model: EvalModel) -> str:
    return f"loglik;bos-window/v1;context={model.context_len}"


@dataclass(frozen=True, slots=True)
class PostProcess:
    """Answer clean-up applied to decoded text before judging; ``version`` names it."""

    version: str
    fn: Callable[[str], str]


@dataclass(frozen=True, slots=True)
class Judge:
    """Scoring rule for one cleaned answer: ``fn(answer, item) -> passed``.

    ``name`` becomes the metric name; exact match or any checker function fits.
    """

    name: str
    version: str
    fn: Callable[[str, GenerationItem], bool]


FIRST_LINE = PostProcess("first-line-strip/v1", lambda text: text.split("\n", 1)[0].strip())
EXACT_MATCH = Judge(
    "exact_match", "exact_match/v1", lambda answer, item: exact_match(answer, item.answer)
)


class HeldoutSuite:
    """Held-out NLL, perplexity and bits per byte over whole documents.

    Every token of every document is scored once (windows as in ``lm``); N_byte is the
    UTF-8 byte count of the documents' text, which those tokens cover exactly.
    """

    higher_is_better = False

    def __init__(self, docs: Sequence[HeldoutDoc], *, name: str = "heldout") -> None:
        self.name = name
        self.docs: tuple[HeldoutDoc, ...] = _non_empty(name, docs)
        self._dataset = dataset_version(self.docs)

    def versions(self, model: EvalModel) -> Versions:
        tokenizer, _ = model.need_lm(self.name)
        return Versions(
            suite="heldout/v1",
            dataset=self._dataset,
            tokenizer=tokenizer.version,
            prompt="bos+text/v1",
            decoding=_likelihood_decoding(model),
        )

    def run(self, model: EvalModel, progress: ProgressSink = NO_PROGRESS) -> list[Score]:
        tokenizer, _ = model.need_lm(self.name)
        requests = [((), tokenizer.encode(doc.text)) for doc in self.docs]
        token_nlls = np.concatenate(continuation_nlls(model, requests, progress))
        nll, ppl = nll_and_ppl(token_nlls)
        n_bytes = sum(utf8_byte_count(doc.text) for doc in self.docs)
        bpb = bits_per_byte(math.fsum(token_nlls.tolist()), n_bytes)
        n = len(self.docs)
        return [
            Score(metric="nll", value=nll, n_items=n, higher_is_better=False),
            Score(metric="ppl", value=ppl, n_items=n, higher_is_better=False),
            Score(metric="bpb", value=bpb, n_items=n, higher_is_better=False),
        ]


class ChoiceSuite:
    """Multiple-choice accuracy, picking the option with the lowest normalised NLL.

    Option i of question q is scored as the continuation " " + option after the
    question (prompt ``question+space+option/v1``); its summed NLL is divided by the
    continuation's length in tokens or UTF-8 bytes (the joining space included), or
    not at all, per ``normalization``, which is part of the suite version.
    """

    higher_is_better = True

    def __init__(
        self,
        items: Sequence[ChoiceItem],
        *,
        normalization: Normalization = "bytes",
        name: str = "choice",
    ) -> None:
        self.name = name
        self.items: tuple[ChoiceItem, ...] = _non_empty(name, items)
        self.normalization = normalization
        self._version = choice_suite_version("choice/v1", normalization)
        self._dataset = dataset_version(self.items)

    def versions(self, model: EvalModel) -> Versions:
        tokenizer, _ = model.need_lm(self.name)
        return Versions(
            suite=self._version,
            dataset=self._dataset,
            tokenizer=tokenizer.version,
            prompt="question+space+option/v1",
            decoding=_likelihood_decoding(model),
            judge=f"argmin-nll-per-{self.normalization}/v1",
        )

    def run(self, model: EvalModel, progress: ProgressSink = NO_PROGRESS) -> list[Score]:
        tokenizer, _ = model.need_lm(self.name)
        requests: list[tuple[list[int], list[int]]] = []
        lengths: list[list[float]] = []
        for item in self.items:
            context = tokenizer.encode(item.question)
            row: list[float] = []
            for option in item.options:
                continuation = tokenizer.encode(" " + option)
                requests.append((context, continuation))
                row.append(
                    float(
                        len(continuation)
                        if self.normalization == "tokens"
                        else utf8_byte_count(" " + option)
                    )
                )
            lengths.append(row)
        sums = iter([math.fsum(x.tolist()) for x in continuation_nlls(model, requests, progress)])
        option_nlls = [[next(sums) for _ in item.options] for item in self.items]
        result = choice_accuracy(
            option_nlls,
            None if self.normalization == "none" else lengths,
            [item.answer for item in self.items],
            self.normalization,
        )
        return [
            Score(
                metric="accuracy",
                value=result.accuracy,
                n_items=len(self.items),
                higher_is_better=True,
            )
        ]


class GenerationSuite:
    """Greedy decoding at temperature 0, cleaned by ``postprocess``, scored by ``judge``.

    Decoding stops at a newline or after ``max_new_tokens`` tokens.
    """

    higher_is_better = True

    def __init__(
        self,
        items: Sequence[GenerationItem],
        *,
        max_new_tokens: int = 16,
        postprocess: PostProcess = FIRST_LINE,
        judge: Judge = EXACT_MATCH,
        name: str = "generation",
    ) -> None:
        self.name = name
        self.items: tuple[GenerationItem, ...] = _non_empty(name, items)
        self.max_new_tokens = max_new_tokens
        self.postprocess = postprocess
        self.judge = judge
        self._dataset = dataset_version(self.items)
        self.last_answers: list[str] = []

    def versions(self, model: EvalModel) -> Versions:
        tokenizer, _ = model.need_lm(self.name)
        return Versions(
            suite="generation/v1",
            dataset=self._dataset,
            tokenizer=tokenizer.version,
            prompt="raw-prompt/v1",
            decoding=f"greedy;T=0;max_new_tokens={self.max_new_tokens};stop=\\n;"
            f"context={model.context_len}",
            postprocess=self.postprocess.version,
            judge=self.judge.version,
        )

    def run(self, model: EvalModel, progress: ProgressSink = NO_PROGRESS) -> list[Score]:
        tokenizer, _ = model.need_lm(self.name)
        outputs = generate(
            model,
            [tokenizer.encode(item.prompt) for item in self.items],
            max_new_tokens=self.max_new_tokens,
            stop="\n",
            progress=progress,
        )
        self.last_answers = [self.postprocess.fn(tokenizer.decode(o)) for o in outputs]
        passed = [
            self.judge.fn(a, item) for a, item in zip(self.last_answers, self.items, strict=True)
        ]
        return [
            Score(
                metric=self.judge.name,
                value=sum(passed) / len(passed),
                n_items=len(passed),
                higher_is_better=True,
            )
        ]


class PassAtKSuite:
    """pass@k with the unbiased estimator over ``n`` sampled completions per problem.

    Sampling uses softmax(logits / temperature) and ``sampler`` (default: multinomial
    from a generator seeded with ``seed`` at the start of every run, so raw and EMA
    weights see the same random stream). pass@k per problem is 1 − C(n−c, k)/C(n, k)
    (1 when n − c < k), averaged over problems.
    """

    higher_is_better = True

    def __init__(
        self,
        items: Sequence[GenerationItem],
        *,
        n: int = 8,
        ks: Sequence[int] = (1, 4),
        temperature: float = 0.8,
        seed: int = 0,
        max_new_tokens: int = 16,
        sampler: Sampler | None = None,
        postprocess: PostProcess = FIRST_LINE,
        judge: Judge = EXACT_MATCH,
        name: str = "pass_at_k",
    ) -> None:
        self.name = name
        self.items: tuple[GenerationItem, ...] = _non_empty(name, items)
        if not ks or any(not 1 <= k <= n for k in ks):
            raise EvaluationError(f"suite {name}: every k must lie in [1, n={n}], got {ks}")
        if not temperature > 0:
            raise EvaluationError(f"suite {name}: sampling needs temperature > 0")
        self.n, self.ks, self.temperature = n, tuple(ks), temperature
        self.max_new_tokens = max_new_tokens
        self.sampler: Sampler = sampler if sampler is not None else SeededSampler(seed)
        self.seed = seed
        self.postprocess, self.judge = postprocess, judge
        self._dataset = dataset_version(self.items)
        self.last_passes: list[int] = []

    def versions(self, model: EvalModel) -> Versions:
        tokenizer, _ = model.need_lm(self.name)
        sampler = getattr(self.sampler, "version", type(self.sampler).__name__)
        return Versions(
            suite="pass_at_k/v1",
            dataset=self._dataset,
            tokenizer=tokenizer.version,
            prompt="raw-prompt/v1",
            decoding=f"sample;T={self.temperature:g};n={self.n};seed={self.seed};"
            f"sampler={sampler};max_new_tokens={self.max_new_tokens};"
            f"stop=\\n;context={model.context_len}",
            postprocess=self.postprocess.version,
            judge=self.judge.version,
        )

    def run(self, model: EvalModel, progress: ProgressSink = NO_PROGRESS) -> list[Score]:
        tokenizer, _ = model.need_lm(self.name)
        reset = getattr(self.sampler, "reset", None)
        if reset is not None:
            reset()
        prompts = [tokenizer.encode(item.prompt) for item in self.items for _ in range(self.n)]
        sample_ids = [s for _ in self.items for s in range(self.n)]
        outputs = generate(
            model,
            prompts,
            max_new_tokens=self.max_new_tokens,
            stop="\n",
            progress=progress,
            temperature=self.temperature,
            sampler=self.sampler,
            sample_ids=sample_ids,
        )
        self.last_passes = []
        for q, item in enumerate(self.items):
            answers = outputs[q * self.n : (q + 1) * self.n]
            self.last_passes.append(
                sum(
                    bool(self.judge.fn(self.postprocess.fn(tokenizer.decode(o)), item))
                    for o in answers
                )
            )
        n_items = len(self.items)
        return [
            Score(
                metric=f"pass@{k}",
                n_items=n_items,
                higher_is_better=True,
                value=math.fsum(pass_at_k(self.n, c, k) for c in self.last_passes) / n_items,
            )
            for k in self.ks
        ]


class GroundingSuite:
    """Mean IoU of predicted boxes against reference boxes on procedural images.

    The model answers ``predict_box(image, prompt)`` (see ``images``). A malformed box
    (not four finite numbers with x1 >= x0, y1 >= y0) scores 0.
    """

    higher_is_better = True

    def __init__(
        self, items: Sequence[GroundingItem], *, image_size: int = 32, name: str = "grounding"
    ) -> None:
        self.name = name
        self.items: tuple[GroundingItem, ...] = _non_empty(name, items)
        self.image_size = image_size
        self._dataset = dataset_version(self.items)

    def versions(self, model: EvalModel) -> Versions:
        return Versions(
            suite="grounding/v1",
            dataset=self._dataset,
            tokenizer="none",
            prompt=f"raw-prompt/v1;{IMAGE_VERSION}@{self.image_size}",
            decoding="predict_box/v1",
            judge="iou/v1",
        )

    def run(self, model: EvalModel, progress: ProgressSink = NO_PROGRESS) -> list[Score]:
        progress.set_total(len(self.items))
        values: list[float] = []
        for item in self.items:
            image, _ = render_image(item.image_seed, self.image_size)
            predicted = model.predict_box(image, item.prompt)
            try:
                values.append(iou(tuple(predicted), item.box))
            except (TypeError, ValueError):
                values.append(0.0)
            progress.advance()
        return [
            Score(
                metric="iou",
                value=math.fsum(values) / len(values),
                n_items=len(values),
                higher_is_better=True,
            )
        ]


class _TwoPasses:
    """Progress over two runs of the same suite: the total counts both."""

    def __init__(self, inner: ProgressSink) -> None:
        self.inner = inner
        self.started = False

    def set_total(self, total: int) -> None:
        if not self.started:
            self.inner.set_total(2 * total)
            self.started = True

    def advance(self, n: int = 1) -> None:
        self.inner.advance(n)


class MediaGain:
    """Δ_media = score with media − score with media removed, for a higher-is-better suite.

    Runs ``inner`` twice through the model's media switch (``EvalModel.with_media``)
    and reports, per higher-is-better metric m, ``m_with_media``, ``m_without_media``
    and ``m_media_gain``.
    """

    higher_is_better = True

    def __init__(self, inner: Suite, *, name: str | None = None) -> None:
        if not inner.higher_is_better:
            raise EvaluationError(
                f"media gain needs a higher-is-better suite; {inner.name} is lower-is-better"
            )
        self.inner = inner
        self.name = name or f"{inner.name}_media"

    def versions(self, model: EvalModel) -> Versions:
        inner = self.inner.versions(model)
        return Versions(
            suite=f"{inner.suite}+media-gain/v1",
            dataset=inner.dataset,
            tokenizer=inner.tokenizer,
            prompt=inner.prompt,
            decoding=inner.decoding,
            postprocess=inner.postprocess,
            judge=inner.judge,
        )

    def run(self, model: EvalModel, progress: ProgressSink = NO_PROGRESS) -> list[Score]:
        both = _TwoPasses(progress)
        with_media = self.inner.run(model.with_media(True), both)
        without = {s.metric: s for s in self.inner.run(model.with_media(False), both)}
        scores: list[Score] = []
        for on in with_media:
            if not on.higher_is_better:
                continue
            off = without[on.metric]
            scores += [
                Score(
                    metric=f"{on.metric}_with_media",
                    value=on.value,
                    n_items=on.n_items,
                    higher_is_better=True,
                ),
                Score(
                    metric=f"{on.metric}_without_media",
                    value=off.value,
                    n_items=off.n_items,
                    higher_is_better=True,
                ),
                Score(
                    metric=f"{on.metric}_media_gain",
                    value=media_gain(on.value, off.value),
                    n_items=on.n_items,
                    higher_is_better=True,
                ),
            ]
        return scores
