"""Stage 1 spread over workers: a rank block's mergeable share of a step, and the merge.

A step's rank messages are grouped into rank blocks (``block = rank // B``: contiguous rank
ranges). ``partial_of`` reduces one block's records into a ``Partial``, a mergeable state
per series; ``merge`` combines the partials of a step's blocks into the ``ReducedStep`` that
``reduce.reduce_step`` gives for all the records: the same ranks, hosts, coordinates and
reduced values bit for bit (``per_rank`` keeps only the series named in
``per_rank_names``). Pure: no transport, no I/O.

The state of a series follows its catalog reduction (``reduce._plan``):

* a metric replicated over no group (every rank its own class):
  - SUM: the block's exact sum as a few floats whose exact sum it is (``Sum.parts``;
    parts of 2**960 or more apart, scaled by 2**-960, in ``Sum.big``) and whether a NaN,
    +inf or -inf was among them. Every block's parts summed with ``math.fsum`` is the
    correctly rounded exact sum of all the ranks' values: ``reduce_step``'s sum.
  - MAX / MIN: the block's value (NaN if any value is NaN).
  - MEDIAN: the block's values, in rank order.
* a metric replicated over some group: the lowest rank of each replica class in the block
  that sent the series, with its value. A class can span blocks: the merge keeps the lowest
  rank of each class and reduces those values in rank order, as ``reduce_step``.
* PER_RANK: nothing (``reduce_step`` reduces nothing either).

Memory per partial: O(series) for the sums (a sum's parts are a few floats: one to three
for most, at most ~40), maxima and minima; O(ranks in the block) per series for a median,
a replicated metric and each series named in ``per_rank_names``; plus the block's ranks,
hosts and coordinates. The merge holds the partials of one step.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, repeat

import numpy as np

from probewire.instrument.catalog import Reduction
from probewire.instrument.wire import RankStep, SeriesKey

from .records import CompleteReason, RecordError, ReducedStep, _decode_key, _encode_key
from .reduce import _GROUP_ORDER, _apply, _plan, exact_sum, replica_class, special_sum

__all__ = ["Partial", "Sum", "merge", "partial_of"]

_BIG = 2.0**960
"""Values at least this large (in magnitude) can overflow ``math.fsum`` on the way to a
sum in range; below it, 2**60 of them sum without overflow."""
_NAN, _POS_INF, _NEG_INF = 1, 2, 4  # a Sum's flags on the wire


@dataclass(slots=True)
class Sum:
    """A block's exact sum of one series: ``sum(parts) + sum(big) * 2**960``, exactly
    (finite parts only), and whether a NaN, +inf or -inf was among the values."""

    parts: list[float]
    big: list[float] = field(default_factory=list)
    nan: bool = False
    pos_inf: bool = False
    neg_inf: bool = False


@dataclass(slots=True, kw_only=True)
class Partial:
    """One rank block's share of one (run, step): its ranks and a state per series."""

    run_id: str
    step: int
    world_size: int
    block: int
    ranks: list[int]  # the block's ranks that reported, ascending
    hosts: dict[int, str]
    coords: dict[int, dict[str, int]]
    sums: dict[SeriesKey, Sum] = field(default_factory=dict)
    extrema: dict[SeriesKey, float] = field(default_factory=dict)  # MAX / MIN
    samples: dict[SeriesKey, list[float]] = field(default_factory=dict)  # MEDIAN
    # replicated metrics: the lowest rank of each class that sent the series, its value
    classes: dict[SeriesKey, tuple[list[int], list[float]]] = field(default_factory=dict)
    per_rank: dict[int, dict[SeriesKey, float]] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """Compact wire form: a JSON header naming the series once, then float64 arrays.

        Layout: u32 header length, header JSON, the states' floats in the header's order
        (sums' parts then big parts, extrema, samples, classes' ranks then values), the
        per-rank values [R, P] and their presence [R, P] (uint8). NaN and ±inf survive."""
        return _encode(self)

    @classmethod
    def from_bytes(cls, payload: bytes | None) -> Partial:
        """The partial ``to_bytes`` wrote; a RecordError for anything else."""
        try:
            return _decode(payload or b"")
        except (struct.error, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise RecordError(f"not a partial step: {type(exc).__name__}: {exc}") from None


def _exact_parts(values: Sequence[float], total: float) -> list[float]:
    """Floats whose exact sum is the exact sum of ``values`` (finite, each below 2**960 in
    magnitude), the first ``total`` (their fsum). Each round adds fsum(values - parts so
    far), the correctly rounded rest, so the rest left shrinks by 2**-53 or more a round
    and, being a multiple of 2**-1074, reaches exactly 0: one to three rounds mostly."""
    parts = [total]
    rest = math.fsum([*values, -total])
    while rest != 0:
        parts.append(rest)
        rest = math.fsum([*values, *(-p for p in parts)])
    return parts


def _sum_state(column: Sequence[float]) -> Sum:
    try:
        total = math.fsum(column)
    except (OverflowError, ValueError):
        total = math.inf
    if total - total == 0 and max(map(abs, column)) < _BIG:  # the usual block: finite
        return Sum(_exact_parts(column, total))
    nan, pos_inf, neg_inf = any(v != v for v in column), math.inf in column, -math.inf in column
    if nan or pos_inf or neg_inf:
        return Sum([], nan=nan, pos_inf=pos_inf, neg_inf=neg_inf)
    small = [v for v in column if abs(v) < _BIG]
    big = [math.ldexp(v, -960) for v in column if abs(v) >= _BIG]  # exact: all normal
    return Sum(_exact_parts(small, math.fsum(small)), _exact_parts(big, math.fsum(big)))


def _merge_sums(states: list[Sum]) -> float:
    special = special_sum(
        any(s.nan for s in states), any(s.pos_inf for s in states), any(s.neg_inf for s in states)
    )
    if special is not None:
        return special
    parts = list(chain.from_iterable(s.parts for s in states))
    if any(s.big for s in states):
        return exact_sum(parts, list(chain.from_iterable(s.big for s in states)))
    return math.fsum(parts)  # below 2**960 each, so in range: correctly rounded, exact


def _add_state(
    partial: Partial, key: SeriesKey, reduction: Reduction, column: Sequence[float]
) -> None:
    """The state of a series replicated over no group from its values in rank order."""
    if reduction is Reduction.SUM:
        partial.sums[key] = _sum_state(column)
    elif reduction is Reduction.MEDIAN:
        partial.samples[key] = list(column)
    else:
        partial.extrema[key] = _apply(reduction, column)


def partial_of(
    run_id: str,
    step: int,
    world_size: int,
    block: int,
    records: list[RankStep],
    per_rank_names: frozenset[str],
) -> Partial:
    """The mergeable state of one rank block's records of a step (its ranks that reported)."""
    records = sorted(records, key=lambda r: r.rank)
    values = [r.values for r in records]
    series = tuple(values[0]) if values else ()
    usual = all(tuple(v) == series for v in values)  # one series order: columns built in C
    columns = dict(zip(series, zip(*(v.values() for v in values)))) if usual else {}
    keys: Iterable[SeriesKey] = series if usual else sorted(set().union(*values))
    ranks = [r.rank for r in records]
    partial = Partial(
        run_id=run_id,
        step=step,
        world_size=world_size,
        block=block,
        ranks=ranks,
        hosts={r.rank: r.host for r in records},
        coords={r.rank: dict(r.coords) for r in records},
    )
    classes: dict[tuple[str, ...], list[tuple[int, ...]]] = {}  # groups -> class per record
    firsts: dict[tuple[str, ...], list[int]] = {}  # groups -> first record of each class
    for key in keys:
        reduction, groups = _plan(key[0])
        if reduction is Reduction.PER_RANK:
            continue
        column = columns.get(key)
        if len(groups) == len(_GROUP_ORDER):  # replicated over no group: every rank counts
            if column is None:
                column = tuple(v[key] for v in values if key in v)
            _add_state(partial, key, reduction, column)
            continue
        if groups not in classes:
            classes[groups] = [replica_class(r.rank, r.coords, groups) for r in records]
            first: dict[tuple[int, ...], int] = {}
            for i, cls in enumerate(classes[groups]):
                first.setdefault(cls, i)
            firsts[groups] = list(first.values())
        if column is not None:  # every record sent it
            at = firsts[groups]
            partial.classes[key] = ([ranks[i] for i in at], [column[i] for i in at])
            continue
        chosen: dict[tuple[int, ...], int] = {}  # the lowest rank of each class that sent it
        for i, (cls, record_values) in enumerate(zip(classes[groups], values)):
            if key in record_values:
                chosen.setdefault(cls, i)
        at = list(chosen.values())
        partial.classes[key] = ([ranks[i] for i in at], [values[i][key] for i in at])
    partial.per_rank = _per_rank(records, columns, per_rank_names)
    return partial


def _per_rank(
    records: list[RankStep],
    columns: dict[SeriesKey, tuple[float, ...]],
    names: frozenset[str],
) -> dict[int, dict[SeriesKey, float]]:
    """Each record's values of the series named in ``names``."""
    if not columns:  # series orders differ between ranks
        return {r.rank: {k: v for k, v in r.values.items() if k[0] in names} for r in records}
    keys = [k for k in columns if k[0] in names]
    rows = zip(*(columns[k] for k in keys)) if keys else repeat(())
    return {r.rank: dict(zip(keys, row)) for r, row in zip(records, rows)}


def merge(
    partials: list[Partial], reason: CompleteReason, per_rank_names: frozenset[str]
) -> ReducedStep:
    """The step ``reduce_step`` makes of every record of the blocks of ``partials`` (one
    per block that had ranks), its ``per_rank`` limited to ``per_rank_names``."""
    if not partials:
        raise ValueError("merge needs the partial of at least one block")
    partials = sorted(partials, key=lambda p: p.block)
    head = partials[0]
    reporting = sorted(chain.from_iterable(p.ranks for p in partials))
    coords = {r: c for p in partials for r, c in p.coords.items()}
    sums: dict[SeriesKey, list[Sum]] = {}
    extrema: dict[SeriesKey, list[float]] = {}
    samples: dict[SeriesKey, list[float]] = {}
    for p in partials:
        for key, state in p.sums.items():
            sums.setdefault(key, []).append(state)
        for key, value in p.extrema.items():
            extrema.setdefault(key, []).append(value)
        for key, block_values in p.samples.items():
            samples.setdefault(key, []).extend(block_values)
    chosen = _representatives(partials, coords)
    reduced: dict[SeriesKey, float] = {}
    for key in sorted(chain(sums, extrema, samples, chosen)):
        reduction = _plan(key[0])[0]
        if key in sums:
            reduced[key] = _merge_sums(sums[key])
        elif key in chosen:  # the classes' representatives in rank order, as reduce_step
            reduced[key] = _apply(reduction, [v for _, v in sorted(chosen[key].values())])
        else:
            reduced[key] = _apply(reduction, extrema.get(key) or samples[key])
    return ReducedStep(
        run_id=head.run_id,
        step=head.step,
        world_size=head.world_size,
        ranks_reporting=reporting,
        ranks_missing=sorted(set(range(head.world_size)) - set(reporting)),
        reduced=reduced,
        per_rank=_view(partials, per_rank_names),
        hosts={r: p.hosts[r] for p in partials for r in p.ranks},
        coords={r: dict(coords[r]) for r in reporting},
        complete_reason=reason,
    )


def _representatives(
    partials: list[Partial], coords: dict[int, dict[str, int]]
) -> dict[SeriesKey, dict[tuple[int, ...], tuple[int, float]]]:
    """Each replicated series' replica classes: their lowest rank that sent it, its value."""
    chosen: dict[SeriesKey, dict[tuple[int, ...], tuple[int, float]]] = {}
    class_of: dict[tuple[str, ...], dict[int, tuple[int, ...]]] = {}  # groups -> rank's class
    for p in partials:
        for key, (ranks, rank_values) in p.classes.items():
            groups = _plan(key[0])[1]
            known = class_of.setdefault(groups, {})
            lowest = chosen.setdefault(key, {})
            for rank, value in zip(ranks, rank_values):
                cls = known.get(rank)
                if cls is None:
                    cls = known[rank] = replica_class(rank, coords[rank], groups)
                if cls not in lowest or rank < lowest[cls][0]:
                    lowest[cls] = (rank, value)
    return chosen


def _view(partials: list[Partial], names: frozenset[str]) -> dict[int, dict[SeriesKey, float]]:
    """Each rank's values of the series named in ``names``."""
    per_rank: dict[int, dict[SeriesKey, float]] = {}
    for p in partials:
        if all(k[0] in names for k in set().union(*p.per_rank.values())):  # made with them
            per_rank.update(zip(p.ranks, map(dict, map(p.per_rank.__getitem__, p.ranks))))
        else:
            per_rank.update(
                (r, {k: v for k, v in p.per_rank[r].items() if k[0] in names}) for r in p.ranks
            )
    return per_rank


def _per_rank_arrays(partial: Partial) -> tuple[list[SeriesKey], np.ndarray, np.ndarray]:
    """The per-rank values as a matrix [rank, series] and their presence (uint8)."""
    rows = [partial.per_rank[r] for r in partial.ranks]
    first = tuple(rows[0]) if rows else ()
    if all(tuple(row) == first for row in rows):  # the usual block: one series order
        values = np.fromiter(chain.from_iterable(row.values() for row in rows), np.float64)
        shape = (len(rows), len(first))
        return list(first), values.reshape(shape), np.ones(shape, np.uint8)
    keys = sorted(set().union(*rows))
    matrix = [[row.get(k, math.nan) for k in keys] for row in rows]
    mask = [[k in row for k in keys] for row in rows]
    shape = (len(rows), len(keys))
    return (
        keys,
        np.array(matrix, np.float64).reshape(shape),
        np.array(mask, np.uint8).reshape(shape),
    )


def _encode(partial: Partial) -> bytes:
    per_rank_keys, matrix, mask = _per_rank_arrays(partial)
    keys = sorted(
        set(chain(partial.sums, partial.extrema, partial.samples, partial.classes, per_rank_keys))
    )
    index = {k: i for i, k in enumerate(keys)}
    sums = list(partial.sums.items())
    classes = list(partial.classes.values())
    floats = chain(
        chain.from_iterable(chain(s.parts, s.big) for _, s in sums),
        partial.extrema.values(),
        chain.from_iterable(partial.samples.values()),
        chain.from_iterable(chain(ranks, vals) for ranks, vals in classes),
    )
    header = {
        "run_id": partial.run_id,
        "step": partial.step,
        "world_size": partial.world_size,
        "block": partial.block,
        "ranks": partial.ranks,
        "hosts": [partial.hosts[r] for r in partial.ranks],
        "coords": [partial.coords[r] for r in partial.ranks],
        "sums": [
            [
                index[k],
                len(s.parts),
                len(s.big),
                _NAN * s.nan | _POS_INF * s.pos_inf | _NEG_INF * s.neg_inf,
            ]
            for k, s in sums
        ],
        "extrema": [index[k] for k in partial.extrema],
        "samples": [[index[k], len(v)] for k, v in partial.samples.items()],
        "classes": [[index[k], len(r)] for k, (r, _) in partial.classes.items()],
        "per_rank": [index[k] for k in per_rank_keys],
        "keys": [_encode_key(k) for k in keys],
    }
    text = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return b"".join(
        (
            struct.pack("<I", len(text)),
            text,
            np.fromiter(floats, np.float64).tobytes(),
            matrix.tobytes(),
            mask.tobytes(),
        )
    )


def _ints(value: object, what: str, below: int | None = None) -> list[int]:
    """``value`` as a list of integers from 0 (below ``below``), else a ValueError."""
    if not isinstance(value, list) or not all(
        type(v) is int and 0 <= v < (below if below is not None else v + 1) for v in value
    ):
        raise ValueError(f"{what} is not a list of integers in range")
    return value


def _decode(payload: bytes) -> Partial:
    (size,) = struct.unpack_from("<I", payload)
    head = json.loads(payload[4 : 4 + size])
    keys = [_decode_key(text) for text in head["keys"]]
    ranks = _ints(head["ranks"], "ranks")
    if not isinstance(head["run_id"], str) or not all(
        type(head[f]) is int for f in ("step", "world_size", "block")
    ):
        raise ValueError("bad run id, step, world size or block")
    if not all(isinstance(h, str) for h in head["hosts"]):
        raise ValueError("a host is not a string")
    if not all(
        isinstance(c, dict) and all(type(v) is int for v in c.values()) for c in head["coords"]
    ):
        raise ValueError("coordinates are not integers by group")
    sums = [_ints(s, "a sum") for s in head["sums"]]
    samples = [_ints(s, "samples") for s in head["samples"]]
    classes = [_ints(c, "classes") for c in head["classes"]]
    extrema = _ints(head["extrema"], "extrema", len(keys))
    per_rank = _ints(head["per_rank"], "per_rank", len(keys))
    _ints([s[0] for s in chain(sums, samples, classes)], "series", len(keys))
    count = (
        sum(s[1] + s[2] for s in sums)
        + len(extrema)
        + sum(s[1] for s in samples)
        + 2 * sum(c[1] for c in classes)
    )
    shape = (len(ranks), len(per_rank))
    offset = 4 + size
    if len(payload) != offset + 8 * count + 9 * shape[0] * shape[1]:
        raise ValueError(f"{len(payload)} bytes where the header says otherwise")
    data = iter(np.frombuffer(payload, np.float64, count, offset).tolist())
    offset += 8 * count
    matrix = np.frombuffer(payload, np.float64, shape[0] * shape[1], offset).reshape(shape)
    mask = np.frombuffer(payload, np.uint8, matrix.size, offset + 8 * matrix.size).reshape(shape)
    partial = Partial(
        run_id=head["run_id"],
        step=head["step"],
        world_size=head["world_size"],
        block=head["block"],
        ranks=ranks,
        hosts=dict(zip(ranks, head["hosts"], strict=True)),
        coords=dict(zip(ranks, head["coords"], strict=True)),
    )
    for k, n_parts, n_big, flags in sums:
        partial.sums[keys[k]] = Sum(
            [next(data) for _ in range(n_parts)],
            [next(data) for _ in range(n_big)],
            bool(flags & _NAN),
            bool(flags & _POS_INF),
            bool(flags & _NEG_INF),
        )
    for k in extrema:
        partial.extrema[keys[k]] = next(data)
    for k, n in samples:
        partial.samples[keys[k]] = [next(data) for _ in range(n)]
    for k, n in classes:
        class_ranks = [next(data) for _ in range(n)]
        if not all(r.is_integer() and int(r) in partial.hosts for r in class_ranks):
            raise ValueError("a class's rank is not one of the partial's ranks")
        values = [next(data) for _ in range(n)]
        partial.classes[keys[k]] = ([int(r) for r in class_ranks], values)
    columns = [keys[k] for k in per_rank]
    if mask.all():  # the usual block: every rank sent every series
        partial.per_rank = {
            rank: dict(zip(columns, row)) for rank, row in zip(ranks, matrix.tolist())
        }
    else:
        partial.per_rank = {
            rank: {key: v for key, v, m in zip(columns, row, present) if m}
            for rank, row, present in zip(ranks, matrix.tolist(), mask.tolist())
        }
    return partial
