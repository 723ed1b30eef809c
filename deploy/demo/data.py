"""Training text that ships with Python, as bytes, in two data sources.

``docs``: docstrings of standard-library modules and their public members.
``code``: the standard library's own Python source files.
Batches are padded: each sequence has a random valid length, so ranks see unequal
valid-token counts, which is exactly what makes L differ from the mean of rank means.

With ``media_tiles > 0`` (the demo model's media path) each row also gets 0..media_tiles
procedurally rendered images (``evaluators.images.render_image``: a bright and a dim
rectangle on faint noise), so media length varies per row and some rows, or a whole
batch, carry none. A row with images starts with a caption of its first image's bright
rectangle, e.g. ``<3 4 9 12>\n``, which only the image can predict.
"""

from __future__ import annotations

import importlib
import inspect
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from probewire.evaluators.datasets import DEMO_CORPUS_MODULES
from probewire.evaluators.images import render_image

from .model import BOS, IGNORE

__all__ = ["SOURCES", "Batch", "Corpus", "load_corpus"]

SOURCES = ("docs", "code")
_MODULES = DEMO_CORPUS_MODULES  # the evaluator's demo sets leave these out


def _docstrings() -> str:
    parts: list[str] = []
    for name in _MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr in sorted(getattr(module, "__all__", dir(module))):
            obj = getattr(module, attr, None)
            doc = inspect.getdoc(obj) if obj is not None and not attr.startswith("_") else None
            if doc and getattr(obj, "__module__", name) == name:
                parts.append(f"{attr}: {doc}")
    return "\n\n".join(p for p in parts if p)


def _sources() -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return "\n\n".join(
        (stdlib / f"{m}.py").read_text(encoding="utf-8")
        for m in _MODULES
        if (stdlib / f"{m}.py").is_file()
    )


@dataclass(slots=True)
class Batch:
    tokens: torch.Tensor  # [B, T] inputs (BOS then bytes)
    targets: torch.Tensor  # [B, T] next bytes, IGNORE where padded
    source: torch.Tensor  # [B] index into SOURCES
    media: torch.Tensor | None = None  # [B, N, S, S] images in [0, 1] (media path only)
    media_mask: torch.Tensor | None = None  # [B, N] bool: which of the N image slots are present


@dataclass(slots=True)
class Corpus:
    texts: dict[str, np.ndarray]  # source -> uint8 bytes

    def batch(
        self,
        rng: np.random.Generator,
        batch_size: int,
        seq_len: int,
        min_len: int,
        *,
        media_tiles: int = 0,
        image_size: int = 16,
    ) -> Batch:
        """Padded rows of random valid length in [min_len, seq_len]; with ``media_tiles``
        also 0..media_tiles images per row (drawn after the text, so the text of a given
        ``rng`` state does not depend on whether media is on, captions aside)."""
        tokens = torch.full((batch_size, seq_len), BOS, dtype=torch.long)
        targets = torch.full((batch_size, seq_len), IGNORE, dtype=torch.long)
        source = torch.empty(batch_size, dtype=torch.long)
        for i in range(batch_size):
            s = int(rng.integers(len(SOURCES)))
            data = self.texts[SOURCES[s]]
            n = int(rng.integers(min_len, seq_len + 1))  # valid targets in this row
            start = int(rng.integers(0, len(data) - n))
            chunk = torch.from_numpy(data[start : start + n].astype(np.int64))
            tokens[i, 1:n] = chunk[:-1]
            targets[i, :n] = chunk
            source[i] = s
        if not media_tiles:
            return Batch(tokens, targets, source)
        media = torch.zeros(batch_size, media_tiles, image_size, image_size)
        present = torch.zeros(batch_size, media_tiles, dtype=torch.bool)
        for i in range(batch_size):
            count = int(rng.integers(0, media_tiles + 1))
            for j in range(count):
                image, boxes = render_image(int(rng.integers(2**31)), image_size)
                media[i, j] = torch.from_numpy(image)
                present[i, j] = True
                if j == 0:
                    _caption(tokens[i], targets[i], boxes["bright"])
        return Batch(tokens, targets, source, media, present)


def _caption(tokens: torch.Tensor, targets: torch.Tensor, box: tuple[float, ...]) -> None:
    """Overwrite the start of a row with the bright rectangle's box, as text."""
    text = ("<" + " ".join(str(int(v)) for v in box) + ">\n").encode()
    valid = int((targets != IGNORE).sum())
    n = min(len(text), valid)
    targets[:n] = torch.tensor(list(text[:n]), dtype=torch.long)
    tokens[1:valid] = targets[: valid - 1]  # inputs are the targets shifted by one


def load_corpus() -> Corpus:
    """Both sources as byte arrays (deterministic for a given Python installation)."""
    texts = {"docs": _docstrings(), "code": _sources()}
    return Corpus({k: np.frombuffer(v.encode("utf-8"), dtype=np.uint8) for k, v in texts.items()})
