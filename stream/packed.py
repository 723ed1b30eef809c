"""Float sequences of detector state, packed for the stored state (``stream_state``).

A run's per-rank detectors hold up to a window of floats for every rank; stage 2 saves
their state with every store write. As JSON lists that cost ~0.4 s a step at 2,048 ranks
(every float formatted and parsed); packed, the sequences are one little-endian float64
array in base64 with their lengths: exact (NaN and infinities included) and a few ms.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import numpy as np

__all__ = ["pack", "pairs", "unpack", "unpairs"]


def pack(seqs: Sequence[Sequence[float]]) -> dict[str, Any]:
    """``seqs`` as {"lengths": [...], "f64": base64 of their values one after another}."""
    lengths = [len(s) for s in seqs]
    values = np.fromiter(chain.from_iterable(seqs), "<f8", sum(lengths))
    return {"lengths": lengths, "f64": base64.b64encode(values.tobytes()).decode()}


def unpack(packed: Mapping[str, Any]) -> list[list[float]]:
    """The sequences ``pack`` wrote; ValueError when the lengths do not match the values."""
    lengths = [int(n) for n in packed["lengths"]]
    values = np.frombuffer(base64.b64decode(packed["f64"], validate=True), "<f8")
    if min(lengths, default=0) < 0 or len(values) != sum(lengths):
        raise ValueError(f"{len(values)} packed values for lengths summing to {sum(lengths)}")
    return [part.tolist() for part in np.split(values, np.cumsum(lengths)[:-1])] if lengths else []


def pairs(seqs: Sequence[Sequence[tuple[int, float]]]) -> dict[str, Any]:
    """(step, value) sequences packed as ``pack`` does, each pair two float64 (steps exact
    below 2**53)."""
    lengths = [len(s) for s in seqs]
    flat = chain.from_iterable(chain.from_iterable(seqs))
    values = np.fromiter(flat, "<f8", 2 * sum(lengths))
    return {"lengths": lengths, "f64": base64.b64encode(values.tobytes()).decode()}


def unpairs(packed: Mapping[str, Any]) -> list[list[tuple[int, float]]]:
    """The sequences ``pairs`` wrote."""
    flat = unpack({"lengths": [2 * int(n) for n in packed["lengths"]], "f64": packed["f64"]})
    return [[(int(s), v) for s, v in zip(seq[::2], seq[1::2])] for seq in flat]
