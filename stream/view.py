"""The P0 view of one reduced step (seeds 001 §1-§8) and its detail rows: pure functions of
a ``ReducedStep``, no state, no I/O. Stage 2 calls them for each step it processes.

The view is the registry's (``series.VIEW``): each stored column's formula applied to the
step's components (``inputs.StepInputs``); this module adds only what the detectors read
beside the columns (the per-rank series of the culprit rules, the data sources).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from probewire.instrument.catalog import (
    GRAD_GROUPS,
    TENSOR_FIELDS,
    Grad,
    Label,
    Loss,
    Moe,
    System,
    Tensor,
)
from probewire.instrument.wire import SeriesKey

from .derive import loss_by_group, rank_means
from .inputs import StepInputs, series_reads
from .records import CompleteReason, RankMatrix, ReducedStep
from .series import VIEW
from .signals import RankSeries

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "P0View",
    "RankRows",
    "clip_disagreement",
    "detail_rows",
    "p0_view",
    "rank_rows",
    "rank_schema",
    "rank_table",
]

_TENSOR_FIELD = dict(zip(Tensor.ALL, TENSOR_FIELDS))  # tensor.sum_sq -> sum_sq


@functools.lru_cache(maxsize=1 << 14)
def _tensor_slot(key: SeriesKey) -> tuple[str | None, str | None, str | None]:
    """A tensor statistic's ``tensor_stats`` column, tensor and kind; (None, ...) for a
    series of another metric."""
    field = _TENSOR_FIELD.get(key[0])
    if field is None:
        return None, None, None
    labels = dict(key[1])
    return field, labels.get(Label.TENSOR), labels.get(Label.KIND)


def _rank_series(s: StepInputs) -> RankSeries:
    """Each rank's local mean loss L_r and own-time ratio, and each source's loss over the
    ranks other than the worst one, for the detectors' culprit rules; each residual branch's
    R_b and each gradient group's G_max, for the directional rules."""
    worst = s.worst.rank
    by_source: dict[str, tuple[list[float], list[float]]] = {}
    for index, name in enumerate((Loss.SUM, Loss.TOKENS)):
        for labels, by_rank in s.reads.get(name, {}).items():
            source = dict(labels).get(Label.SOURCE)
            if source is not None:
                by_source.setdefault(source, ([], []))[index].extend(
                    v for r, v in by_rank.items() if r != worst
                )
    return RankSeries(
        loss=rank_means(s.per_rank(Loss.SUM), s.per_rank(Loss.TOKENS)),
        own_ratio=s.own_ratios,
        source_loss_without_worst={  # sum, then divide (seeds 001 §3)
            source: math.fsum(sums) / math.fsum(counts)
            for source, (sums, counts) in by_source.items()
            if sums and math.fsum(counts) > 0
        },
        branch_ratio={b.where: b.ratio for b in s.branches if math.isfinite(b.ratio)},
        group_grad_max={
            g: stats.abs_max
            for g in GRAD_GROUPS
            if (stats := s.grad_stats(**{Label.GROUP: g})) is not None and stats.abs_max is not None
        },
    )


class P0View(NamedTuple):
    """A step's P0 view (``view``: the step_metrics columns it forms, plus ``flops_step``
    and ``moe_maxvio_layer``, which stage 2 and the detectors read and do not store), per
    data source (loss, share, tokens) (``sources``), the per-rank series the detectors'
    culprit rules read (``ranks``)."""

    view: dict[str, Any]
    sources: dict[str, tuple[float, float, float]]
    ranks: RankSeries


def p0_view(item: ReducedStep, inputs: StepInputs | None = None) -> P0View:
    """The step's P0 values from its reduced components and the ranks' values (``inputs``:
    the step's ``StepInputs`` when the caller reads them too)."""
    s = StepInputs(item) if inputs is None else inputs
    view: dict[str, Any] = {c.name: c.formula(s) for c in VIEW}  # type: ignore[misc]
    view["flops_step"] = s.get(System.FLOPS)
    worst = s.experts.worst
    view["moe_maxvio_layer"] = None if worst is None else f"layer {worst[0]}"
    return P0View(view, _sources(s), _rank_series(s))


def _sources(s: StepInputs) -> dict[str, tuple[float, float, float]]:
    """Per data source: (L_mu, pi_mu, N_mu) of the sources with valid tokens (seeds §3)."""
    source_sums = s.labelled(Loss.SUM)
    sums, counts = {}, {}
    for labels, count in s.labelled(Loss.TOKENS).items():
        source = dict(labels).get(Label.SOURCE)
        if source is not None and count > 0 and labels in source_sums:
            sums[source], counts[source] = [source_sums[labels]], [count]
    return loss_by_group(sums, counts, total_tokens=s.tokens)


_CLIP_THRESHOLD = (Grad.CLIP_THRESHOLD, ())


def clip_disagreement(item: ReducedStep) -> dict[float, list[int]] | None:
    """The ranks of each ``grad.clip_threshold`` c they sent, when the ranks of the step
    sent more than one c (seeds 001 §4: one global norm, clipped at one max_norm); None when
    they agree or none sent it. ``grad.clipped`` is then the max over ranks: 1 where any
    rank clipped."""
    ranks: dict[float, list[int]] = {}
    for rank in sorted(item.per_rank):
        c = item.per_rank[rank].get(_CLIP_THRESHOLD)
        if c is not None:
            ranks.setdefault(c, []).append(rank)
    return ranks if len(ranks) > 1 else None


@functools.cache
def rank_schema() -> pa.Schema:
    """``rank_metrics`` as a column batch: each column typed as the store's (strings as
    dictionaries, each text once), so the store converts nothing and no value is inferred.
    (pyarrow is imported here, not with the module: the ranks import this package through
    the settings and must not pay its import time and memory.)"""
    import pyarrow as pa

    return pa.schema(
        [
            ("run_id", pa.dictionary(pa.int32(), pa.string())),
            ("step", pa.uint64()),
            ("rank", pa.uint32()),
            ("metric", pa.dictionary(pa.int32(), pa.string())),
            ("labels", pa.dictionary(pa.int32(), pa.string())),
            ("value", pa.float64()),
            ("late", pa.uint8()),
        ]
    )


@dataclass(frozen=True, slots=True, eq=False)
class RankRows:
    """One step's per-rank values bound for ``rank_metrics`` as the wire carried them (a
    ``RankMatrix``): a store write makes the rows of all it holds into one Arrow table
    (``rank_table``), so a batch of many small steps pays Arrow's fixed costs once."""

    run_id: str
    step: int
    late: int  # 1: not part of the step's reduction (after its deadline, or a replay)
    matrix: RankMatrix


def rank_rows(item: ReducedStep, matrix: RankMatrix) -> RankRows:
    """``item``'s per-rank values (``matrix``) with what their rows carry besides."""
    late = int(item.complete_reason in (CompleteReason.LATE, CompleteReason.REPLAY))
    return RankRows(item.run_id, item.step, late, matrix)


def rank_table(parts: Sequence[RankRows]) -> pa.Table:
    """The ``rank_metrics`` rows of ``parts``: one per rank, metric and label set a rank
    sent, built from the wire's arrays (thousands of values a rank on a scan step; no Python
    object per value), each text once in its column's dictionary."""
    import pyarrow as pa

    schema = rank_schema()
    runs: dict[str, int] = {}
    metrics: dict[str, int] = {}
    labels: dict[str, int] = {}
    cols: dict[str, list[np.ndarray]] = {c: [] for c in schema.names}
    for part in parts:
        m = part.matrix
        read = series_reads(tuple(m.keys))
        metric = _indices(read.names, metrics)
        label = _indices(read.texts, labels)
        at, col = np.nonzero(m.mask)  # row-major: rank after rank, each in key order
        n = at.size
        cols["run_id"].append(np.full(n, runs.setdefault(part.run_id, len(runs)), np.int32))
        cols["step"].append(np.full(n, part.step, np.uint64))
        cols["rank"].append(np.asarray(m.ranks, np.uint32)[at])
        cols["metric"].append(metric[col])
        cols["labels"].append(label[col])
        cols["value"].append(m.values[at, col])
        cols["late"].append(np.full(n, part.late, np.uint8))
    arrays = []
    for field in schema:
        values = np.concatenate(cols[field.name]) if parts else np.zeros(0, np.int32)
        if pa.types.is_dictionary(field.type):
            texts = {"run_id": runs, "metric": metrics, "labels": labels}[field.name]
            arrays.append(
                pa.DictionaryArray.from_arrays(
                    values.astype(np.int32), pa.array(list(texts), pa.string())
                )
            )
        else:
            arrays.append(pa.array(values, field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _indices(texts: list[str], index: dict[str, int]) -> np.ndarray:
    """Each text's index in ``index`` (texts it lacks are added, in first-seen order)."""
    return np.fromiter((index.setdefault(t, len(index)) for t in texts), np.int32, len(texts))


def detail_rows(item: ReducedStep) -> dict[str, list[dict[str, Any]]]:
    """The step's ``tensor_stats`` rows (one per tensor and kind with an element count) and
    ``expert_stats`` rows."""
    base = {"run_id": item.run_id, "step": item.step}
    tensors: dict[tuple, dict[str, Any]] = {}
    experts = []
    for key, value in item.reduced.items():
        field, tensor, kind = _tensor_slot(key)
        if field is not None:
            row = tensors.get((tensor, kind))
            if row is None:
                row = tensors[tensor, kind] = {
                    **base,
                    "tensor": tensor or "",
                    "kind": kind or "",
                    "sum3": None,
                    "sum4": None,
                }
            row[field] = value
            continue
        name, labels = key
        if name == Moe.EXPERT_TOKENS:
            lab = dict(labels)
            experts.append(
                {
                    **base,
                    "layer": lab[Label.LAYER],
                    "expert": int(lab[Label.EXPERT]),
                    "tokens": value,
                    "shard": int(lab.get(Label.SHARD, 0)),
                }
            )
    n = TENSOR_FIELDS[0]  # a tensor's row needs its element count
    return {"tensor_stats": [t for t in tensors.values() if n in t], "expert_stats": experts}
