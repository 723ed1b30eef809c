"""A captioned-image task whose caption only the image can predict, and its suite.

Image ``image_seed`` (a pure function of ``(image_seed, size)``, NumPy PCG64) holds one
object on faint noise, entirely inside one quadrant of the image (so, with the demo
model's 8-pixel patches at ``size=16``, inside one patch). Three properties are drawn from
the seed, each uniformly:

* level: ``bright`` (pixel value 1.0) or ``dim`` (0.5);
* shape: ``square`` (a filled 3×3..5×5 block) or ``line`` (a 1-pixel-high bar, 4..6 wide);
* place: the quadrant, ``top left`` / ``top right`` / ``bottom left`` / ``bottom right``.

The caption is ``"{level} {shape}, {place}\\n"``, e.g. ``"dim line, bottom right\\n"``:
16 captions, 4 bits of information, all of it in the image. ``render_image`` (two
rectangles, captioned by pixel coordinates) is not used: its numeric captions need far
more training than a unit test can afford; this task keeps the same "pure function of a
seed" contract.

``CaptionSuite`` scores a model on captions (higher is better), calling the model through
``EvalModel.logits(tokens, media=images)`` so that ``MediaGain`` can switch the images
off. Metrics:

* ``caption_logprob``: −(Σ caption-byte NLL) / (Σ caption bytes), nats per byte, over the
  whole set (BOS, then the caption bytes; every byte scored once);
* ``caption_accuracy``: fraction of items whose true caption has the lowest summed NLL
  among all 16 candidate captions (ties to the first candidate). A set built by
  ``make_caption_set`` is balanced (every caption equally often when ``n`` is a multiple
  of 16), so any predictor that ignores the image scores exactly 1/16 on it.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .lm import NO_PROGRESS, EvalModel, ProgressSink
from .records import EvaluationError, Versions
from .suites import Score, dataset_version

__all__ = [
    "CAPTIONS",
    "CAPTION_IMAGE_VERSION",
    "CaptionItem",
    "CaptionSuite",
    "caption_batch",
    "caption_for",
    "make_caption_set",
    "render_captioned_image",
]

CAPTION_IMAGE_VERSION = "procedural-one-object-quadrant/v1"
LEVELS = {"bright": 1.0, "dim": 0.5}
SHAPES = ("square", "line")
PLACES = ("top left", "top right", "bottom left", "bottom right")
CAPTIONS: tuple[str, ...] = tuple(
    f"{level} {shape}, {place}\n"
    for level, shape, place in itertools.product(LEVELS, SHAPES, PLACES)
)


def caption_for(level: str, shape: str, place: str) -> str:
    return f"{level} {shape}, {place}\n"


def render_captioned_image(image_seed: int, size: int = 16) -> tuple[np.ndarray, str]:
    """The float32 ``[size, size]`` image in [0, 1] for ``image_seed`` and its caption."""
    if size < 16 or size % 2:
        raise ValueError(f"size must be an even number >= 16, got {size}")
    rng = np.random.default_rng(image_seed)
    image = rng.uniform(0.0, 0.1, size=(size, size)).astype(np.float32)
    level = ("bright", "dim")[int(rng.integers(2))]
    shape = SHAPES[int(rng.integers(2))]
    q = int(rng.integers(4))
    half = size // 2
    if shape == "square":
        w = h = int(rng.integers(3, 6))
    else:
        w, h = int(rng.integers(4, 7)), 1
    x0 = (q % 2) * half + int(rng.integers(0, half - w + 1))
    y0 = (q // 2) * half + int(rng.integers(0, half - h + 1))
    image[y0 : y0 + h, x0 : x0 + w] = LEVELS[level]
    return image, caption_for(level, shape, PLACES[q])


@dataclass(frozen=True, slots=True)
class CaptionItem:
    image_seed: int
    caption: str


def make_caption_set(n: int, seed: int, size: int = 16) -> list[CaptionItem]:
    """``n`` items; captions cycle through all 16 (balanced when 16 divides ``n``): image
    seeds are drawn from ``seed`` until one renders the caption wanted."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    rng = random.Random(seed)
    items: list[CaptionItem] = []
    for i in range(n):
        wanted = CAPTIONS[i % len(CAPTIONS)]
        while True:
            image_seed = rng.randrange(2**31)
            _, caption = render_captioned_image(image_seed, size)
            if caption == wanted:
                items.append(CaptionItem(image_seed, caption))
                break
    return items


def caption_batch(
    image_seeds: Sequence[int],
    captions: Sequence[str] | None = None,
    *,
    size: int = 16,
    bos: int = 256,
    seq_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [B, T], targets [B, T], images [B, 1, S, S]) for training or scoring.

    Row i is BOS followed by the caption bytes (its own caption unless ``captions`` is
    given); targets are the caption bytes, −100 on padding. T is the longest caption,
    or ``seq_len``."""
    images, texts = [], []
    for k, s in enumerate(image_seeds):
        image, caption = render_captioned_image(int(s), size)
        images.append(image)
        texts.append((caption if captions is None else captions[k]).encode())
    width = seq_len or max(len(t) for t in texts)
    tokens = torch.zeros((len(texts), width), dtype=torch.long)
    targets = torch.full((len(texts), width), -100, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = torch.tensor(list(t), dtype=torch.long)
        tokens[i, 0] = bos
        tokens[i, 1 : len(t)] = ids[:-1]
        targets[i, : len(t)] = ids
    return tokens, targets, torch.from_numpy(np.stack(images))[:, None]


class CaptionSuite:
    """Caption log-probability per byte and 16-way caption accuracy (module docstring)."""

    higher_is_better = True

    def __init__(
        self, items: Sequence[CaptionItem], *, image_size: int = 16, name: str = "caption"
    ) -> None:
        if len(items) == 0:
            raise EvaluationError(f"suite {name}: empty dataset, nothing to score")
        self.name = name
        self.items: tuple[CaptionItem, ...] = tuple(items)
        self.image_size = image_size
        self._dataset = dataset_version(self.items)

    def versions(self, model: EvalModel) -> Versions:
        tokenizer, _ = model.need_lm(self.name)
        return Versions(
            suite="caption/v1",
            dataset=self._dataset,
            tokenizer=tokenizer.version,
            prompt=f"bos+caption/v1;{CAPTION_IMAGE_VERSION}@{self.image_size}",
            decoding="loglik;single-window/v1",
            judge="argmin-summed-nll-of-16/v1",
        )

    def _summed_nlls(self, model: EvalModel, seeds: list[int], captions: list[str]) -> np.ndarray:
        tokenizer, context_len = model.need_lm(self.name)
        out: list[np.ndarray] = []
        for start in range(0, len(seeds), max(model.batch_size, 1)):
            s, c = (
                seeds[start : start + model.batch_size],
                captions[start : start + model.batch_size],
            )
            tokens, targets, images = caption_batch(
                s, c, size=self.image_size, bos=tokenizer.bos_id
            )
            if tokens.shape[1] > context_len:
                raise EvaluationError(f"suite {self.name}: caption longer than the context")
            with torch.inference_mode():
                logp = (
                    model.logits(tokens.to(model.device), media=images.to(model.device))
                    .log_softmax(-1)
                    .cpu()
                )
            valid = targets != -100
            nll = -logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            out.append((nll * valid).sum(-1).numpy())
        return np.concatenate(out)

    def run(self, model: EvalModel, progress: ProgressSink = NO_PROGRESS) -> list[Score]:
        n = len(self.items)
        progress.set_total(2)
        seeds = [it.image_seed for it in self.items]
        own = self._summed_nlls(model, seeds, [it.caption for it in self.items])
        n_bytes = sum(len(it.caption.encode()) for it in self.items)
        logprob = -math.fsum(own.tolist()) / n_bytes
        progress.advance()
        k = len(CAPTIONS)
        every = self._summed_nlls(
            model, [s for s in seeds for _ in range(k)], [c for _ in seeds for c in CAPTIONS]
        ).reshape(n, k)
        picked = every.argmin(axis=1)  # first minimum wins ties
        correct = sum(CAPTIONS[p] == it.caption for p, it in zip(picked, self.items, strict=True))
        progress.advance()
        return [
            Score(metric="caption_logprob", value=logprob, n_items=n, higher_is_better=True),
            Score(metric="caption_accuracy", value=correct / n, n_items=n, higher_is_better=True),
        ]
