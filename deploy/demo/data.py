"""Training text that ships with Python, as bytes, in two data sources.

``docs``: docstrings of standard-library modules and their public members.
``code``: the standard library's own Python source files.
Batches are padded: each sequence has a random valid length, so ranks see unequal
valid-token counts, which is exactly what makes L differ from the mean of rank means.
"""

from __future__ import annotations

import importlib
import inspect
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .model import BOS, IGNORE

__all__ = ["SOURCES", "Batch", "Corpus", "load_corpus"]

SOURCES = ("docs", "code")
_MODULES = ("json", "collections", "functools", "itertools", "pathlib", "argparse", "textwrap",
            "string", "re", "heapq", "bisect", "statistics", "fractions", "decimal", "datetime",
            "calendar", "random", "math", "os", "shutil", "subprocess", "logging", "typing",
            "dataclasses", "enum", "csv", "abc", "contextlib", "operator", "copy")


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
    return "\n\n".join((stdlib / f"{m}.py").read_text(encoding="utf-8")
                       for m in _MODULES if (stdlib / f"{m}.py").is_file())


@dataclass(slots=True)
class Batch:
    tokens: torch.Tensor   # [B, T] inputs (BOS then bytes)
    targets: torch.Tensor  # [B, T] next bytes, IGNORE where padded
    source: torch.Tensor   # [B] index into SOURCES


@dataclass(slots=True)
class Corpus:
    texts: dict[str, np.ndarray]  # source -> uint8 bytes

    def batch(self, rng: np.random.Generator, batch_size: int, seq_len: int,
              min_len: int) -> Batch:
        tokens = torch.full((batch_size, seq_len), BOS, dtype=torch.long)
        targets = torch.full((batch_size, seq_len), IGNORE, dtype=torch.long)
        source = torch.empty(batch_size, dtype=torch.long)
        for i in range(batch_size):
            s = int(rng.integers(len(SOURCES)))
            data = self.texts[SOURCES[s]]
            n = int(rng.integers(min_len, seq_len + 1))  # valid targets in this row
            start = int(rng.integers(0, len(data) - n))
            chunk = torch.from_numpy(data[start:start + n].astype(np.int64))
            tokens[i, 1:n] = chunk[:-1]
            targets[i, :n] = chunk
            source[i] = s
        return Batch(tokens, targets, source)


def load_corpus() -> Corpus:
    """Both sources as byte arrays (deterministic for a given Python installation)."""
    texts = {"docs": _docstrings(), "code": _sources()}
    return Corpus({k: np.frombuffer(v.encode("utf-8"), dtype=np.uint8) for k, v in texts.items()})
