"""Deterministic fakes for testing suites: models whose answers are known in closed form.

``BigramLM`` returns a fixed row of logits for each input token, so every token's NLL
is a NumPy one-liner; ``QuantileSampler`` replaces random draws by evenly spaced
quantiles, so sample i of n picks the token whose cumulative probability first reaches
(i + ½)/n; ``CharTokenizer`` makes a token out of every character, so tokens and UTF-8
bytes differ as soon as the text is not ASCII; ``ThresholdBoxPredictor`` answers a
grounding prompt by thresholding the rendered image (or, without one, with a fixed guess).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

__all__ = ["BigramLM", "CharTokenizer", "QuantileSampler", "ThresholdBoxPredictor"]

Box = tuple[float, float, float, float]


class BigramLM(nn.Module):
    """logits[b, t] = table[tokens[b, t]] (float64): the next token depends on this one only."""

    table: torch.Tensor  # a registered buffer

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        table = np.asarray(table, dtype=np.float64)
        if table.ndim != 2 or table.shape[0] != table.shape[1]:
            raise ValueError(f"table must be square [V, V], got {table.shape}")
        self.register_buffer("table", torch.from_numpy(table.copy()))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table[tokens]


@dataclass(frozen=True, slots=True)
class CharTokenizer:
    """One token per character of ``alphabet``; BOS is ``len(alphabet)``."""

    alphabet: str
    version: str = "chars/test"
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", {c: i for i, c in enumerate(self.alphabet)})

    @property
    def bos_id(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        return [self._index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.alphabet[i] for i in ids if 0 <= i < len(self.alphabet))


@dataclass(frozen=True, slots=True)
class QuantileSampler:
    """Sample i of ``n`` takes the first token whose cumulative probability >= (i + ½)/n."""

    n: int
    version: str = "quantile/test"

    def __call__(self, probs: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
        cdf = probs.double().cumsum(-1)
        u = (sample_ids.double().to(cdf.device) + 0.5) / self.n
        return torch.searchsorted(cdf, u.unsqueeze(-1)).squeeze(-1).clamp(max=probs.shape[-1] - 1)


@dataclass(frozen=True, slots=True)
class ThresholdBoxPredictor:
    """A deterministic grounding "model" for tests.

    With an image it thresholds the level named in the prompt and returns the bounding
    box of those pixels; without one (media removed) it answers with the centred box
    covering the middle half of the image, a text-prior guess. ``use_media=False``
    makes a predictor that ignores the image altogether.
    """

    size: int = 32
    use_media: bool = True

    def predict_box(self, image: np.ndarray | None, prompt: str) -> Box:
        if image is None or not self.use_media:
            q = self.size / 4
            return (q, q, 3 * q, 3 * q)
        mask = image > 0.75 if "bright" in prompt else (image > 0.3) & (image < 0.75)
        ys, xs = np.nonzero(mask)
        if xs.size == 0:
            return (0.0, 0.0, 0.0, 0.0)
        return (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))
