"""Typed records that move between the stream's stages (plain data, JSON on the wire)."""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import chain

import numpy as np

from probewire.instrument.wire import SeriesKey

__all__ = ["CompleteReason", "RankMatrix", "RecordError", "ReducedStep"]


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


def _decode_keys(texts: bytes) -> list[SeriesKey]:
    """The keys of a header's ``"keys":[...]`` JSON array (its bytes): a run's steps carry
    the same keys, so the list is parsed once and looked up after."""
    keys = _KEYS.get(texts)
    if keys is None:
        keys = [_decode_key(text) for text in json.loads(texts)]
        if len(_KEYS) >= _LAYOUTS_MAX:
            _KEYS.clear()
        _KEYS[texts] = keys
    return keys


def _decode_key(text: str) -> SeriesKey:
    known = _TEXT_KEY.get(text)
    if known is not None:
        return known
    name, *pairs = text.split("|")
    labels = [p.split("=", 1) for p in pairs]
    if any(len(label) != 2 for label in labels):
        raise ValueError(f"a label without '=' in series {text!r}")
    key = name, tuple((k, v) for k, v in labels)
    if len(_TEXT_KEY) >= _CACHE_MAX:
        _TEXT_KEY.clear()
    _TEXT_KEY[text] = key
    return key


_KEY_TEXT: dict[SeriesKey, str] = {}
_TEXT_KEY: dict[str, SeriesKey] = {}
_CACHE_MAX = 1 << 16
"""Series keys and their text, both ways: a run sends the same series every step (so a
step's keys are looked up, not formatted or parsed); bounded, emptied when full."""
_KEYS: dict[bytes, list[SeriesKey]] = {}
_LAYOUTS_MAX = 64
"""Step layouts kept, both ways (``_layout`` to write, ``_KEYS`` to read): a run has one
or a few (a step split for the broker's limit has one a part); a layout of K series holds
~150 bytes a series, so at most ~0.5 MB each for a step of 500 tensors' statistics."""


class CompleteReason(StrEnum):
    """Why a reduced step was emitted: the ``complete_reason`` that stage 2 branches on and
    ClickHouse stores (the values are stored: never change one)."""

    ALL_RANKS = "all_ranks"  # every rank of the step reported (or its message was refused)
    DEADLINE = "deadline"  # its deadline passed with ranks missing (or the worker stopped)
    LATER_STEP = "later_step"  # stored by older workers: closed by a later step (no more)
    LATE = "late"  # a rank's data after its step was emitted: kept as detail
    REPLAY = "replay"  # the ranks' ring buffers, sent on a dump: a past step's detail
    DETAIL = "detail"  # a detail part of a step split for the broker's message limit
    SCAN = "scan"  # the step's scan-tier detail, sent by its ranks apart (topic ``detail``)
    AFTER_GAP = "after_gap"  # set by stage 2: the first step after a gap in the run


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where a step's reduced series and its ranks' series go among its sorted keys."""

    size: int
    reduced: np.ndarray  # column of each reduced series, in the step's order
    series: np.ndarray  # column of each series of the ranks (``RankMatrix.keys``), in order
    keys_json: bytes  # ',"keys":[...]}': the header's end


@functools.lru_cache(maxsize=_LAYOUTS_MAX)
def _layout(reduced: tuple[SeriesKey, ...], series: tuple[SeriesKey, ...]) -> _Layout:
    """The layout of a step with these reduced series and per-rank series: the same every
    step of a run, so it is made once (the keys sorted, their text written)."""
    keys = sorted(set(reduced).union(series))
    index = {k: i for i, k in enumerate(keys)}
    texts = json.dumps([_encode_key(k) for k in keys], separators=(",", ":"))
    return _Layout(
        len(keys),
        np.array([index[k] for k in reduced], np.intp),
        np.array([index[k] for k in series], np.intp),
        f',"keys":{texts}}}'.encode(),
    )


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
    complete_reason: CompleteReason = CompleteReason.ALL_RANKS

    def to_bytes(self) -> bytes:
        """Compact wire form: a JSON header naming the series once, then float64 arrays.

        Layout: u32 header length, header JSON, reduced values [K], their presence [K]
        (uint8), per-rank values [R, K], their presence [R, K]. NaN and ±Inf survive as is.
        """
        ranks = sorted(self.per_rank)
        matrix = RankMatrix.of({r: self.per_rank[r] for r in ranks})
        layout = _layout(tuple(self.reduced), tuple(matrix.keys))
        values = np.full((len(ranks), layout.size), np.nan)
        mask = np.zeros((len(ranks), layout.size), np.uint8)
        values[:, layout.series] = matrix.values
        mask[:, layout.series] = matrix.mask
        reduced = np.full(layout.size, np.nan)
        reduced_mask = np.zeros(layout.size, np.uint8)
        reduced[layout.reduced] = np.fromiter(self.reduced.values(), np.float64, len(self.reduced))
        reduced_mask[layout.reduced] = 1
        header = (
            json.dumps(
                {  # "keys" last, written once per layout
                    "run_id": self.run_id,
                    "step": self.step,
                    "world_size": self.world_size,
                    "ranks_reporting": self.ranks_reporting,
                    "ranks_missing": self.ranks_missing,
                    "hosts": {str(r): h for r, h in self.hosts.items()},
                    "coords": {str(r): c for r, c in self.coords.items()},
                    "complete_reason": self.complete_reason,
                    "ranks": ranks,
                },
                separators=(",", ":"),
            ).encode()[:-1]
            + layout.keys_json
        )
        return b"".join(
            (
                struct.pack("<I", len(header)),
                header,
                reduced.tobytes(),
                reduced_mask.tobytes(),
                values.tobytes(),
                mask.tobytes(),
            )
        )

    @classmethod
    def from_bytes(cls, payload: bytes | None) -> ReducedStep:
        """The step ``to_bytes`` wrote; a RecordError for anything else."""
        step, matrix = cls.detail_from_bytes(payload)
        step.per_rank = matrix.per_rank()
        return step

    @classmethod
    def detail_from_bytes(cls, payload: bytes | None) -> tuple[ReducedStep, RankMatrix]:
        """The step ``to_bytes`` wrote, its per-rank values left as the wire's arrays
        (``per_rank`` empty): the detail path stores them column-wise, with no Python
        object per value. A RecordError for anything else."""
        try:
            step, matrix = cls._from_bytes(payload or b"")
        except (struct.error, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise RecordError(f"not a reduced step: {type(exc).__name__}: {exc}") from None
        if not isinstance(step.run_id, str) or not isinstance(step.step, int):
            raise RecordError("not a reduced step: bad run id or step")
        return step, matrix

    @classmethod
    def _from_bytes(cls, payload: bytes) -> tuple[ReducedStep, RankMatrix]:
        (size,) = struct.unpack_from("<I", payload)
        header = payload[4 : 4 + size]
        cut = header.rfind(b',"keys":')  # the last field; no string holds an unescaped '"'
        if cut < 0 or not header.endswith(b"}"):
            raise ValueError("no keys in the header")
        head = json.loads(header[:cut] + b"}")
        keys = _decode_keys(header[cut + 8 : -1])
        ranks = head.pop("ranks")
        k, r, offset = len(keys), len(ranks), 4 + size
        reduced = np.frombuffer(payload, np.float64, k, offset)
        reduced_mask = np.frombuffer(payload, np.uint8, k, offset + 8 * k)
        offset += 9 * k
        values = np.frombuffer(payload, np.float64, r * k, offset).reshape(r, k)
        mask = np.frombuffer(payload, np.uint8, r * k, offset + 8 * r * k).reshape(r, k)
        if reduced_mask.all():  # the usual step: every series reduced
            head["reduced"] = dict(zip(keys, reduced.tolist()))
        else:
            head["reduced"] = {
                keys[j]: v
                for j, v in zip(
                    np.flatnonzero(reduced_mask).tolist(), reduced[reduced_mask == 1].tolist()
                )
            }
        head["per_rank"] = {}
        head["hosts"] = {int(x): h for x, h in head["hosts"].items()}
        head["coords"] = {int(x): c for x, c in head["coords"].items()}
        head["complete_reason"] = CompleteReason(head["complete_reason"])  # else a ValueError
        return cls(**head), RankMatrix(keys, ranks, values, mask)


@dataclass(frozen=True, slots=True)
class RankMatrix:
    """A reduced step's per-rank values as they travel: ``values[i, j]`` is rank
    ``ranks[i]``'s value of series ``keys[j]`` where ``mask[i, j]`` is 1 (NaN and ±Inf
    are values; a 0 in the mask is a series the rank did not send)."""

    keys: list[SeriesKey]
    ranks: list[int]
    values: np.ndarray  # float64 [R, K]
    mask: np.ndarray  # uint8 [R, K]

    @classmethod
    def of(cls, per_rank: dict[int, dict[SeriesKey, float]]) -> RankMatrix:
        """``ReducedStep.per_rank`` as a matrix (ranks in its order; the series in the ranks'
        order where all sent the same ones, else sorted)."""
        ranks = list(per_rank)
        series = tuple(per_rank[ranks[0]]) if ranks else ()
        if all(tuple(v) == series for v in per_rank.values()):  # the usual step
            values = np.fromiter(
                chain.from_iterable(v.values() for v in per_rank.values()),
                np.float64,
                len(ranks) * len(series),
            ).reshape(len(ranks), len(series))
            return cls(list(series), ranks, values, np.ones(values.shape, np.uint8))
        keys = sorted(set().union(*per_rank.values()))
        index = {k: j for j, k in enumerate(keys)}
        values = np.full((len(ranks), len(keys)), np.nan)
        mask = np.zeros((len(ranks), len(keys)), np.uint8)
        for i, sent in enumerate(per_rank.values()):
            cols = [index[k] for k in sent]
            values[i, cols] = list(sent.values())
            mask[i, cols] = 1
        return cls(keys, ranks, values, mask)

    def per_rank(self) -> dict[int, dict[SeriesKey, float]]:
        """``ReducedStep.per_rank``: a dict of the series each rank sent, in key order."""
        keys, ranks, values, mask = self.keys, self.ranks, self.values, self.mask
        if mask.all():  # the usual step: every rank sent every series
            return {rank: dict(zip(keys, row)) for rank, row in zip(ranks, values.tolist())}
        if ranks and (mask == mask[0]).all():  # every rank the same series, fewer than reduced
            cols = np.flatnonzero(mask[0])
            sent = [keys[j] for j in cols.tolist()]
            return {
                rank: dict(zip(sent, row)) for rank, row in zip(ranks, values[:, cols].tolist())
            }
        return {
            rank: {
                keys[j]: v
                for j, v in zip(np.flatnonzero(mask[i]).tolist(), values[i, mask[i] == 1].tolist())
            }
            for i, rank in enumerate(ranks)
        }
