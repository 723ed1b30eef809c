"""The model side of evaluation: tokenizer protocol, model wrapper, scoring and decoding.

A *language model* here is any callable mapping token ids ``[B, T]`` (long) to logits
``[B, T, V]`` (a tensor, or an object with ``.logits``). Inputs are right-padded:
every supported model is causal, so padding after a position never changes it.

Windowing (part of every likelihood suite's version, ``"bos-window"``): the model sees
at most ``context_len`` positions. The targets are cut into consecutive blocks of
``context_len`` tokens; each block is scored in one window that starts with BOS and
fills the remaining positions with the tokens just before the block. A full block
therefore sees only BOS before it; a shorter block (the last one, or a choice option
after its question) sees as much earlier text as fits. Every target is scored exactly
once. The demo model is trained on exactly this shape (BOS, then a slice of text).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from .records import EvaluationError

__all__ = [
    "ByteTokenizer",
    "EvalModel",
    "NullProgress",
    "ProgressSink",
    "Sampler",
    "SeededSampler",
    "Tokenizer",
    "continuation_nlls",
    "generate",
    "resolve_callable",
]


@runtime_checkable
class Tokenizer(Protocol):
    """What the suites need from a tokenizer. ``version`` names its vocabulary and rules."""

    bos_id: int
    version: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, BOS = 256 (the demo's TinyLM vocabulary)."""

    bos_id: int = 256
    version: str = "utf8-bytes/v1"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class ProgressSink(Protocol):
    """Where a suite reports progress; the runner adds a progress bar and cancellation."""

    def set_total(self, total: int) -> None: ...

    def advance(self, n: int = 1) -> None: ...


class NullProgress:
    """A progress sink that does nothing."""

    def set_total(self, total: int) -> None:
        pass

    def advance(self, n: int = 1) -> None:
        pass


NO_PROGRESS = NullProgress()


def resolve_callable(spec: str, what: str) -> Callable[..., Any]:
    """``module:attr`` -> the callable it names, or a one-line ``EvaluationError``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise EvaluationError(f"{what} {spec!r}: expected 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EvaluationError(
            f"{what} {spec!r}: module {module_name!r} does not import ({type(exc).__name__}: {exc})"
        ) from None
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise EvaluationError(f"{what} {spec!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise EvaluationError(
            f"{what} {spec!r}: {attr!r} is not callable (it is a {type(target).__name__})"
        )
    return target


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` (directly or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(
        (p.name == name and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        or p.kind is p.VAR_KEYWORD
        for p in params
    )


@dataclass(kw_only=True, slots=True, frozen=True)
class EvalModel:
    """A loaded model as the suites see it.

    ``module`` is a language model (see the module docstring) or, for grounding, an
    object with ``predict_box(image, prompt)``. ``media`` is the media switch: when
    False every media input is replaced by None before the model sees it, which is how
    media gain removes media.
    """

    module: Any
    tokenizer: Tokenizer | None = None
    context_len: int | None = None
    batch_size: int = 16
    device: str = "cpu"
    media: bool = True

    def with_media(self, on: bool) -> EvalModel:
        return dataclasses.replace(self, media=on)

    def need_lm(self, suite: str) -> tuple[Tokenizer, int]:
        if self.tokenizer is None or self.context_len is None:
            raise EvaluationError(
                f"suite {suite} needs a language model with a tokenizer and a context length"
            )
        return self.tokenizer, self.context_len

    def logits(self, tokens: torch.Tensor, media: Any = None) -> torch.Tensor:
        """float64 logits ``[B, T, V]`` for ``tokens`` ``[B, T]``; media only when switched on."""
        media = media if self.media else None
        out = self.module(tokens) if media is None else self.module(tokens, media=media)
        out = getattr(out, "logits", out)
        if not isinstance(out, torch.Tensor) or out.dim() != 3 or out.shape[:2] != tokens.shape:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise EvaluationError(
                f"model returned {shape} for tokens {tuple(tokens.shape)}; "
                f"expected logits [B, T, V]"
            )
        return out.double()

    def predict_box(self, image: np.ndarray | None, prompt: str) -> Any:
        predict = getattr(self.module, "predict_box", None)
        if predict is None:
            raise EvaluationError("suite grounding needs a model with predict_box(image, prompt)")
        return predict(image if self.media else None, prompt)


# --- likelihood ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Window:
    request: int
    inputs: list[int]  # BOS + context, len L <= context_len
    targets: list[int]  # len L; targets[p] is predicted at position p
    first: int  # targets[first:] are scored (the rest is context)


def _windows(
    request: int, context: Sequence[int], target: Sequence[int], bos: int, context_len: int
) -> list[_Window]:
    seq = [*context, *target]
    out: list[_Window] = []
    j = len(context)
    while j < len(seq):
        n = min(context_len, len(seq) - j)  # targets scored in this window
        a = max(0, j + n - context_len)  # first sequence index the window sees
        out.append(_Window(request, [bos, *seq[a : j + n - 1]], list(seq[a : j + n]), j - a))
        j += n
    return out


def continuation_nlls(
    model: EvalModel,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    progress: ProgressSink,
) -> list[np.ndarray]:
    """Per-token NLL (nats, float64) of each ``target`` given BOS + its ``context``.

    ``requests`` holds ``(context_ids, target_ids)`` pairs; an empty target yields an
    empty array. Windows follow the module docstring; ``progress`` counts windows.
    """
    tokenizer, context_len = model.need_lm("likelihood")
    windows = [
        w
        for i, (ctx, tgt) in enumerate(requests)
        for w in _windows(i, ctx, tgt, tokenizer.bos_id, context_len)
    ]
    progress.set_total(len(windows))
    parts: list[list[np.ndarray]] = [[] for _ in requests]
    for start in range(0, len(windows), model.batch_size):
        batch = windows[start : start + model.batch_size]
        width = max(len(w.inputs) for w in batch)
        tokens = torch.zeros((len(batch), width), dtype=torch.long)
        targets = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            tokens[row, : len(w.inputs)] = torch.tensor(w.inputs)
            targets[row, : len(w.targets)] = torch.tensor(w.targets)
        with torch.inference_mode():
            logp = model.logits(tokens.to(model.device)).log_softmax(-1)
            nll = -logp.gather(-1, targets.to(model.device).unsqueeze(-1)).squeeze(-1).cpu()
        for row, w in enumerate(batch):
            parts[w.request].append(nll[row, w.first : len(w.targets)].numpy())
        progress.advance(len(batch))
    return [np.concatenate(p) if p else np.zeros(0) for p in parts]


# --- decoding ------------------------------------------------------------------------

Sampler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``sampler(probs [N, V] float64, sample_ids [N] long) -> tokens [N]``: picks the next
token of each row; ``sample_ids`` says which of a problem's n samples a row is."""


@dataclass(slots=True)
class SeededSampler:
    """Multinomial sampling from a generator seeded once per suite run."""

    seed: int
    version: str = "multinomial/v1"
    _generator: torch.Generator | None = None

    def reset(self) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)

    def __call__(self, probs: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
        if self._generator is None:
            self.reset()
        return torch.multinomial(probs.cpu(), 1, generator=self._generator).squeeze(-1)


def generate(
    model: EvalModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop: str | None,
    progress: ProgressSink,
    temperature: float = 0.0,
    sampler: Sampler | None = None,
    sample_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Continue each prompt (token ids, without BOS) by up to ``max_new_tokens`` tokens.

    Temperature 0 is greedy (argmax, ties to the lowest id); otherwise ``sampler``
    draws from softmax(logits / temperature). A row stops early once its decoded
    continuation contains ``stop``. Each step feeds BOS + the last ``context_len − 1``
    tokens. ``progress`` counts finished rows.
    """
    tokenizer, context_len = model.need_lm("generation")
    if temperature > 0 and sampler is None:
        raise ValueError("sampling (temperature > 0) needs a sampler")
    ids = list(sample_ids) if sample_ids is not None else [0] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    progress.set_total(len(prompts))
    for start in range(0, len(prompts), model.batch_size):
        live = list(range(start, min(start + model.batch_size, len(prompts))))
        for _ in range(max_new_tokens):
            rows = [
                [tokenizer.bos_id, *([*prompts[i], *outputs[i]][-(context_len - 1) :])]
                for i in live
            ]
            width = max(len(r) for r in rows)
            tokens = torch.zeros((len(rows), width), dtype=torch.long)
            for r, row in enumerate(rows):
                tokens[r, : len(row)] = torch.tensor(row)
            last = torch.tensor([len(r) - 1 for r in rows])
            with torch.inference_mode():
                logits = model.logits(tokens.to(model.device))
                logits = logits[torch.arange(len(rows)), last.to(model.device)]
                if temperature > 0:
                    probs = (logits / temperature).softmax(-1)
                    chosen = sampler(probs, torch.tensor([ids[i] for i in live]))
                else:
                    chosen = logits.argmax(-1)
            still: list[int] = []
            for i, token in zip(live, chosen.tolist(), strict=True):
                outputs[i].append(int(token))
                if stop is not None and stop in tokenizer.decode(outputs[i]):
                    progress.advance()
                else:
                    still.append(i)
            live = still
            if not live:
                break
        progress.advance(len(live))
    return outputs
