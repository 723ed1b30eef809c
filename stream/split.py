"""Reduced steps that fit the broker's message limit, with P0 always in the first part.

A reduced step carries every rank's components; 64 ranks x 500 tensors is about 1.6 MB,
over Kafka's usual 1 MB. Such a step leaves stage 1 as several messages of the same key
(so the same partition, in order): first *detail* parts (``CompleteReason.DETAIL``:
per-rank values and tensor statistics, each part a subset), then the *main* part: every
reduced value stage 2's view reads and the per-rank values it reads (``inputs.PER_RANK``).
Stage 2 stores a detail part's rows in the look-back tables at once and processes the
main part as the step; the main part's retention decision promotes the detail parts,
which are written before it. Rows are never split: a tensor's fields stay together. A
scan-tier step (``CompleteReason.SCAN``) splits the same way, its main part keeping every
reduced value when they fit (stage 2 joins them to the step's row).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from probewire.instrument.catalog import CATALOG, Priority, Tensor
from probewire.instrument.wire import SeriesKey

from .inputs import PER_RANK
from .records import CompleteReason, ReducedStep

__all__ = ["OversizeStep", "split_step", "wire_parts"]
_TENSOR = frozenset(Tensor.ALL)


class OversizeStep(ValueError):
    """Even the main part (P0 values) of a step is over the limit."""


def split_step(step: ReducedStep, max_bytes: int) -> list[tuple[ReducedStep, bytes]]:
    """The step as (part, its bytes) in publishing order, each at most ``max_bytes``."""
    whole = step.to_bytes()
    if len(whole) <= max_bytes:
        return [(step, whole)]
    view_rank = {
        r: {k: v for k, v in values.items() if k[0] in PER_RANK}
        for r, values in step.per_rank.items()
    }
    detail_rank = {
        r: {k: v for k, v in values.items() if k[0] not in PER_RANK}
        for r, values in step.per_rank.items()
    }
    keeps = [
        lambda k: k[0] not in _TENSOR,
        lambda k: k[0] not in _TENSOR and CATALOG[k[0]].priority is Priority.P0,
    ]
    if step.complete_reason == CompleteReason.SCAN:  # stage 2 joins its reduced values
        keeps.insert(0, lambda k: True)  # to its step's row: all of them in one part
    for keep in keeps:
        main = dataclasses.replace(
            step, per_rank=view_rank, reduced={k: v for k, v in step.reduced.items() if keep(k)}
        )
        main_bytes = main.to_bytes()
        if len(main_bytes) <= max_bytes:
            break
    else:
        raise OversizeStep(
            f"step {step.step} of run {step.run_id!r}: even its P0 part is "
            f"{len(main_bytes)} bytes, over stream.max_message_bytes={max_bytes}"
        )
    rest = {k: v for k, v in step.reduced.items() if k not in main.reduced}
    by_row: dict[tuple, dict[SeriesKey, float]] = defaultdict(dict)  # one tensor's fields
    for key, value in rest.items():
        by_row[key[1]][key] = value
    parts = _fit(step, [g for _, g in sorted(by_row.items())], {}, max_bytes)
    parts += _fit(step, [], {r: v for r, v in detail_rank.items() if v}, max_bytes)
    return parts + [(main, main_bytes)]


def wire_parts(step: ReducedStep, max_bytes: int) -> list[tuple[bool, bytes]]:
    """The step as stage 1 publishes it, in order: (whether the part goes to the detail
    topic, its bytes). Detail never rides stage 2's ordered path: a replay goes whole to
    the detail topic; a scan-tier step's per-rank values and tensor statistics go there as
    detail parts, and its reduced values alone to stage 2 (which joins them to its step's
    row); any other step's detail parts go there and its main part to stage 2."""
    if step.complete_reason == CompleteReason.REPLAY:
        return [(True, data) for _, data in split_step(step, max_bytes)]
    out: list[tuple[bool, bytes]] = []
    if step.complete_reason == CompleteReason.SCAN:
        detail = dataclasses.replace(step, complete_reason=CompleteReason.DETAIL)
        out = [(True, data) for _, data in split_step(detail, max_bytes)]
        step = dataclasses.replace(step, per_rank={}, hosts={}, coords={})
    return out + [
        (part.complete_reason == CompleteReason.DETAIL, data)
        for part, data in split_step(step, max_bytes)
    ]


def _fit(
    step: ReducedStep,
    groups: list[dict[SeriesKey, float]],
    per_rank: dict[int, dict[SeriesKey, float]],
    max_bytes: int,
) -> list[tuple[ReducedStep, bytes]]:
    """A detail part of ``groups`` (tensor rows) and ``per_rank`` values, halved (by rows,
    by ranks, by a rank's series) until each part fits."""
    if not groups and not per_rank:
        return []
    part = ReducedStep(
        run_id=step.run_id,
        step=step.step,
        world_size=step.world_size,
        ranks_reporting=sorted(per_rank),
        ranks_missing=[],
        reduced={k: v for g in groups for k, v in g.items()},
        per_rank=per_rank,
        hosts={r: step.hosts.get(r, "") for r in per_rank},
        complete_reason=CompleteReason.DETAIL,
    )
    data = part.to_bytes()
    if len(data) <= max_bytes:
        return [(part, data)]
    halves: list[tuple[list[dict[SeriesKey, float]], dict[int, dict[SeriesKey, float]]]]
    if len(groups) > 1:
        mid = len(groups) // 2
        halves = [(groups[:mid], {}), (groups[mid:], {})]
    elif len(per_rank) > 1:
        ranks = sorted(per_rank)
        mid = len(ranks) // 2
        halves = [
            ([], {r: per_rank[r] for r in ranks[:mid]}),
            ([], {r: per_rank[r] for r in ranks[mid:]}),
        ]
    elif per_rank and len(next(iter(per_rank.values()))) > 1:
        ((rank, values),) = per_rank.items()
        keys = sorted(values)
        mid = len(keys) // 2
        halves = [
            ([], {rank: {k: values[k] for k in keys[:mid]}}),
            ([], {rank: {k: values[k] for k in keys[mid:]}}),
        ]
    else:
        raise OversizeStep(
            f"step {step.step} of run {step.run_id!r}: one series is over "
            f"stream.max_message_bytes={max_bytes}"
        )
    return [p for g, r in halves for p in _fit(step, g, r, max_bytes)]
