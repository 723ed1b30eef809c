"""Float sequences of detector state, packed for the stored state (``stream_state``).

A run's per-rank detectors hold up to a window of floats for every rank; stage 2 saves
their state with every store write. As JSON lists that cost ~0.4 s a step at 2,048 ranks
(every float formatted and parsed); packed, the sequences are one little-endian float64
array in base64 with their lengths: exact (NaN and infinities included) and a few ms.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping, Sequence
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


def pairs(seqs: Iterable[Iterable[tuple[int, float]]]) -> dict[str, Any]:
    """(step, value) sequences: the steps and the values packed apart (steps < 2**53)."""
    seqs = [list(s) for s in seqs]
    return {
        "steps": pack([[float(p[0]) for p in s] for s in seqs]),
        "values": pack([[p[1] for p in s] for s in seqs]),
    }


def unpairs(packed: Mapping[str, Any]) -> list[list[tuple[int, float]]]:
    steps, values = unpack(packed["steps"]), unpack(packed["values"])
    if [len(s) for s in steps] != [len(v) for v in values]:
        raise ValueError("packed steps and values differ in length")
    return [[(int(s), v) for s, v in zip(ss, vs)] for ss, vs in zip(steps, values)]
