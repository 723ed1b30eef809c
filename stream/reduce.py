"""Stage 1's reduction of one step's rank records across ranks (pure: no transport).

The reduction of each metric comes from the catalog: one representative per replica class (ranks that differ
only in groups the metric is replicated over), then sum / max / min / median over the
representatives (a metric replicated over no group: every rank is its own class). Means
and ratios are formed later from the reduced components. A sum is the exact sum of its
parts, correctly rounded (``math.fsum``), so no order of the ranks or split of them into
blocks (``partial``) can change it. A non-finite component stays visible: a NaN makes the
reduced value NaN, a sum of +inf and -inf is NaN, and a sum whose exact value is past the
float64 range is ±inf by its sign (as NumPy's float64 sum).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from fractions import Fraction

from probewire.instrument.catalog import CATALOG, Group, Reduction
from probewire.instrument.wire import RankStep, SeriesKey

from .records import CompleteReason, ReducedStep

__all__ = ["exact_sum", "reduce_step", "replica_class", "special_sum"]


_GROUP_ORDER = tuple(g.value for g in Group)


@functools.cache
def _distinguishing(replicated_over: frozenset[Group]) -> tuple[str, ...]:
    """The parallel groups whose coordinates tell two non-replica ranks apart."""
    return tuple(g for g in _GROUP_ORDER if Group(g) not in replicated_over)


def _replica_class(record: RankStep, groups: tuple[str, ...]) -> tuple[int, ...]:
    return replica_class(record.rank, record.coords, groups)


def replica_class(rank: int, coords: dict[str, int], groups: tuple[str, ...]) -> tuple[int, ...]:
    """The replica class of a rank for a metric distinguished by ``groups``: a metric
    replicated over no group has one class a rank, whatever its coordinates say."""
    if len(groups) == len(_GROUP_ORDER):
        return (rank,)
    coords = coords or {Group.DATA.value: rank}
    return tuple(coords.get(g, 0) for g in groups)


@functools.cache
def _plan(name: str) -> tuple[Reduction, tuple[str, ...]]:
    """A metric's reduction and the groups whose coordinates make its replica classes."""
    spec = CATALOG[name]
    return spec.reduction, _distinguishing(spec.replicated_over)


@functools.lru_cache(maxsize=64)
def _sorted_keys(series: tuple[SeriesKey, ...]) -> list[SeriesKey]:
    """A step's series in sorted order (the reduced values' order), sorted once per run."""
    return sorted(series)


def exact_sum(parts: Sequence[float], big: Sequence[float] = ()) -> float:
    """The exact sum of finite ``parts`` plus ``big`` × 2**960, correctly rounded (as
    ``math.fsum``), ±inf by its sign past the float64 range: whatever the parts' order."""
    exact = sum(map(Fraction, parts), Fraction(0)) + sum(map(Fraction, big), Fraction(0)) * (
        1 << 960
    )
    try:
        return float(exact)  # int / int: correctly rounded, as fsum
    except OverflowError:
        return math.inf if exact > 0 else -math.inf


def special_sum(nan: bool, pos_inf: bool, neg_inf: bool) -> float | None:
    """The sum of parts some of which are NaN or ±inf (None when all are finite)."""
    if nan or (pos_inf and neg_inf):
        return math.nan  # one NaN for every NaN in: no payload or order shows through
    if pos_inf or neg_inf:
        return math.inf if pos_inf else -math.inf
    return None


def _sum(values: Sequence[float]) -> float:
    try:
        total = math.fsum(values)
    except (OverflowError, ValueError):  # past the range on the way, or +inf and -inf
        total = math.inf
    if total - total == 0:  # finite: fsum's arithmetic stayed in range, so it is exact
        return total
    if total != total:
        return math.nan
    # ±inf: an infinite part, or fsum overflowed (the exact sum may still be in range)
    special = special_sum(any(v != v for v in values), math.inf in values, -math.inf in values)
    return exact_sum(values) if special is None else special


def _apply(reduction: Reduction, values: Sequence[float]) -> float:
    if reduction is Reduction.SUM:  # exact, so the ranks' order cannot change it
        return _sum(values)
    if any(v != v for v in values):
        return math.nan  # a non-finite component stays visible after reduction
    if reduction is Reduction.MAX:
        return max(values)
    if reduction is Reduction.MIN:
        return min(values)
    if reduction is Reduction.MEDIAN:
        return float(statistics.median(values))
    raise ValueError(f"no cross-rank value for reduction {reduction}")


def reduce_step(
    run_id: str, step: int, world_size: int, records: list[RankStep], reason: CompleteReason
) -> ReducedStep:
    """Reduce one step's per-rank records with the catalog's rules."""
    records = sorted(records, key=lambda r: r.rank)
    values = [r.values for r in records]
    series = tuple(values[0]) if values else ()
    if all(tuple(v) == series for v in values):  # the usual step: one series order
        keys = _sorted_keys(series)
        everywhere: set[SeriesKey] | frozenset[SeriesKey] = frozenset(series)
        # each series' values over the records, built in C: no lookup per rank and series
        columns = dict(zip(series, zip(*(v.values() for v in values))))
    else:
        keys = sorted(set().union(*values))
        everywhere = set(values[0]).intersection(*values[1:])
        columns = {}
    reduced: dict[SeriesKey, float] = {}
    classes: dict[tuple[str, ...], list[tuple[int, ...]]] = {}  # groups -> class per record
    firsts: dict[tuple[str, ...], list[int]] = {}  # groups -> first record of each class
    for key in keys:
        reduction, groups = _plan(key[0])
        if reduction is Reduction.PER_RANK:
            continue
        if groups not in classes:
            classes[groups] = [_replica_class(r, groups) for r in records]
            first: dict[tuple[int, ...], int] = {}
            for i, cls in enumerate(classes[groups]):
                first.setdefault(cls, i)
            firsts[groups] = list(first.values())
        # the lowest rank of each replica class that reported this series
        column = columns.get(key)
        representatives: Sequence[float]
        if column is not None and len(firsts[groups]) == len(records):  # no replicas
            representatives = column
        elif key in everywhere:
            representatives = [values[i][key] for i in firsts[groups]]
        else:
            chosen: dict[tuple[int, ...], float] = {}
            for record_values, cls in zip(values, classes[groups]):
                if key in record_values:
                    chosen.setdefault(cls, record_values[key])
            representatives = list(chosen.values())
        reduced[key] = _apply(reduction, representatives)
    reporting = [r.rank for r in records]
    return ReducedStep(
        run_id=run_id,
        step=step,
        world_size=world_size,
        ranks_reporting=reporting,
        ranks_missing=sorted(set(range(world_size)) - set(reporting)),
        reduced=reduced,
        per_rank={r.rank: dict(r.values) for r in records},
        hosts={r.rank: r.host for r in records},
        coords={r.rank: dict(r.coords) for r in records},
        complete_reason=reason,
    )
