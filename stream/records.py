"""Typed records that move between the stream's stages (plain data, JSON on the wire)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np

from probewire.instrument.wire import SeriesKey

__all__ = ["RecordError", "ReducedStep"]


class RecordError(ValueError):
    """Bytes that are not a ReducedStep; ``reason`` goes to the dead letter."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _encode_key(key: SeriesKey) -> str:
    text = _KEY_TEXT.get(key)
    if text is None:
        name, labels = key
        text = name + "".join(f"|{k}={v}" for k, v in labels)
        if len(_KEY_TEXT) >= _CACHE_MAX:
            _KEY_TEXT.clear()
        _KEY_TEXT[key] = text
    return text


def _decode_key(text: str) -> SeriesKey:
    key = _TEXT_KEY.get(text)
    if key is None:
        name, *pairs = text.split("|")
        key = name, tuple(tuple(p.split("=", 1)) for p in pairs)  # type: ignore[assignment]
        if len(_TEXT_KEY) >= _CACHE_MAX:
            _TEXT_KEY.clear()
        _TEXT_KEY[text] = key
    return key


_KEY_TEXT: dict[SeriesKey, str] = {}
_TEXT_KEY: dict[str, SeriesKey] = {}
_CACHE_MAX = 1 << 16
"""Series keys and their text, both ways: a run sends the same series every step (so a
step's keys are looked up, not formatted or parsed); bounded, emptied when full."""


@dataclass(slots=True, kw_only=True)
class ReducedStep:
    """Stage 1's output for one (run, step): reduced values plus the per-rank components."""

    run_id: str
    step: int
    world_size: int
    ranks_reporting: list[int]
    ranks_missing: list[int]
    reduced: dict[SeriesKey, float]
    per_rank: dict[int, dict[SeriesKey, float]]
    hosts: dict[int, str] = field(default_factory=dict)
    coords: dict[int, dict[str, int]] = field(default_factory=dict)  # rank -> {dp: i, ...}
    complete_reason: str = "all_ranks"  # or "deadline", "later_step", "late", "replay"

    def to_bytes(self) -> bytes:
        """Compact wire form: a JSON header naming the series once, then float64 arrays.

        Layout: u32 header length, header JSON, reduced values [K], their presence [K]
        (uint8), per-rank values [R, K], their presence [R, K]. NaN and ±Inf survive as is.
        """
        per_rank = self.per_rank
        ranks = sorted(per_rank)
        first = tuple(per_rank[ranks[0]]) if ranks else ()
        same = all(tuple(per_rank[r]) == first for r in ranks)  # the usual step
        keys = sorted(set(self.reduced).union(first) if same else
                      set(self.reduced).union(*(v.keys() for v in per_rank.values())))
        index = {k: i for i, k in enumerate(keys)}
        reduced = np.full(len(keys), np.nan)
        reduced_mask = np.zeros(len(keys), np.uint8)
        if self.reduced:
            cols = [index[k] for k in self.reduced]
            reduced[cols], reduced_mask[cols] = list(self.reduced.values()), 1
        values = np.full((len(ranks), len(keys)), np.nan)
        mask = np.zeros((len(ranks), len(keys)), np.uint8)
        if same and ranks:  # one column order for every rank: one assignment
            cols = [index[k] for k in first]
            values[:, cols] = [list(per_rank[r].values()) for r in ranks]
            mask[:, cols] = 1
        else:
            for i, rank in enumerate(ranks):
                cols = [index[k] for k in per_rank[rank]]
                values[i, cols] = list(per_rank[rank].values())
                mask[i, cols] = 1
        header = json.dumps({
            "run_id": self.run_id, "step": self.step, "world_size": self.world_size,
            "ranks_reporting": self.ranks_reporting, "ranks_missing": self.ranks_missing,
            "hosts": {str(r): h for r, h in self.hosts.items()},
            "coords": {str(r): c for r, c in self.coords.items()},
            "complete_reason": self.complete_reason, "ranks": ranks,
            "keys": [_encode_key(k) for k in keys]}, separators=(",", ":")).encode()
        return b"".join((struct.pack("<I", len(header)), header, reduced.tobytes(),
                         reduced_mask.tobytes(), values.tobytes(), mask.tobytes()))

    @classmethod
    def from_bytes(cls, payload: bytes | None) -> "ReducedStep":
        """The step ``to_bytes`` wrote; a RecordError for anything else."""
        try:
            step = cls._from_bytes(payload or b"")
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RecordError(f"not a reduced step: {type(exc).__name__}: {exc}") from None
        if not isinstance(step.run_id, str) or not isinstance(step.step, int) or \
                not all(len(labels) == 2 for key in step.reduced for labels in key[1]):
            raise RecordError("not a reduced step: bad run id, step or labels")
        return step

    @classmethod
    def _from_bytes(cls, payload: bytes) -> "ReducedStep":
        (size,) = struct.unpack_from("<I", payload)
        head = json.loads(payload[4:4 + size])
        keys = [_decode_key(k) for k in head.pop("keys")]
        ranks = head.pop("ranks")
        k, r, offset = len(keys), len(ranks), 4 + size
        reduced = np.frombuffer(payload, np.float64, k, offset)
        reduced_mask = np.frombuffer(payload, np.uint8, k, offset + 8 * k)
        offset += 9 * k
        values = np.frombuffer(payload, np.float64, r * k, offset).reshape(r, k)
        mask = np.frombuffer(payload, np.uint8, r * k, offset + 8 * r * k).reshape(r, k)
        if reduced_mask.all():  # the usual step: every series reduced, every rank all
            head["reduced"] = dict(zip(keys, reduced.tolist()))
        else:
            head["reduced"] = {keys[j]: v for j, v in zip(
                np.flatnonzero(reduced_mask).tolist(), reduced[reduced_mask == 1].tolist())}
        if mask.all():
            head["per_rank"] = {rank: dict(zip(keys, row))
                                for rank, row in zip(ranks, values.tolist())}
        else:
            head["per_rank"] = {
                rank: {keys[j]: v for j, v in zip(np.flatnonzero(mask[i]).tolist(),
                                                  values[i, mask[i] == 1].tolist())}
                for i, rank in enumerate(ranks)}
        head["hosts"] = {int(x): h for x, h in head["hosts"].items()}
        head["coords"] = {int(x): c for x, c in head["coords"].items()}
        return cls(**head)
