"""A reduced step's components, read once, for the registry's formulas (``series``).

``StepInputs`` wraps one ``ReducedStep``: its reduced values grouped by metric name, the
per-rank values the view reads (``PER_RANK``), and the few intermediate results several
stored series share (the worst rank, the ranks' own times, the expert layers' balance, the
weakest residual branch, the learning rates). Each is computed on first use and kept, so a
step's formulas read every component once. Pure: no state across steps, no I/O; the
arithmetic is ``derive``'s.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from typing import Any, NamedTuple

from probewire.instrument.catalog import (
    Comm,
    Grad,
    Group,
    Label,
    Loss,
    Memory,
    Moe,
    Optim,
    Residual,
    System,
    Tensor,
)
from probewire.instrument.wire import Labels, SeriesKey

from .derive import (
    ExpertBalance,
    GradStats,
    Spread,
    expert_balance,
    grad_stats,
    mean_from_components,
    own_time_ratios,
    own_times,
    shard_imbalance,
    spread,
    update_ratio,
    worst_rank_loss,
)
from .records import ReducedStep

__all__ = [
    "PER_RANK",
    "RankReads",
    "StepInputs",
    "by_name",
    "rank_reads",
    "series_reads",
]

PER_RANK = frozenset(
    {
        Loss.SUM,
        Loss.TOKENS,
        System.STEP_TIME,
        Comm.WAIT,
        Memory.PEAK_ALLOCATED,
        Memory.PEAK_RSS,
        Memory.CAPACITY,
    }
)
"""The metrics whose per-rank values the view reads (any labels); the rest of a step's
per-rank values are detail only."""

_GRAD = (Grad.ABS_SUM, Grad.ABS_MAX, Grad.ZEROS, Grad.ELEMENTS, Grad.NONFINITE)
_RATIO_SUM, _STREAM_NORM_SUM, _BRANCH_NORM_SUM = (
    Residual.name(stat, "sum") for stat in ("ratio", "stream_norm", "branch_norm")
)


def by_name(values: Mapping[SeriesKey, float]) -> dict[str, dict[Labels, float]]:
    """The values grouped by metric name, in one pass: each helper then looks its names up
    instead of scanning every series of the step again."""
    out: dict[str, dict[Labels, float]] = {}
    for (name, labels), value in values.items():
        found = out.get(name)
        if found is None:
            found = out[name] = {}
        found[labels] = value
    return out


RankReads = dict[str, dict[Labels, dict[int, float]]]
"""A step's per-rank values of the view's metrics (``PER_RANK``) by name, label set and rank."""


class SeriesReads(NamedTuple):
    """What the view and the detail read of a rank's series, found once per series order
    (ranks send the same series in the same order step after step)."""

    keys: list[SeriesKey]  # the view's series (``PER_RANK``), in order...
    positions: Any  # ...their itemgetter in the rank's values
    names: list[str]  # every series' metric name...
    texts: list[str]  # ...and label text (``rank_metrics`` columns)


@functools.lru_cache(maxsize=64)
def series_reads(series: tuple[SeriesKey, ...]) -> SeriesReads:
    at = [i for i, (name, _) in enumerate(series) if name in PER_RANK]
    return SeriesReads(
        [series[i] for i in at],
        itemgetter(*at) if at else None,
        [name for name, _ in series],
        ["|".join(f"{k}={v}" for k, v in labels) for _, labels in series],
    )


def rank_reads(item: ReducedStep) -> RankReads:
    """One pass over the step's per-rank values: the view, the formed series and the
    detectors' rank series then look their metrics up instead of walking every value of
    every rank again (hundreds a step; the rest are detail only)."""
    out: RankReads = {}
    series: tuple[SeriesKey, ...] = ()
    read = series_reads(series)
    for rank, values in item.per_rank.items():
        if tuple(values) != series:  # the previous rank's: its read (no hashing of the keys)
            series = tuple(values)
            read = series_reads(series)
        if read.keys:  # the view's series among the rank's, by position
            row = read.positions(tuple(values.values()))
            for (name, labels), value in zip(read.keys, row if len(read.keys) > 1 else (row,)):
                out.setdefault(name, {}).setdefault(labels, {})[rank] = value
    return out


@dataclass(frozen=True, slots=True)
class Worst:
    """L_max and the rank holding it (``derive.worst_rank_loss``)."""

    loss: float | None
    rank: int | None


@dataclass(frozen=True, slots=True)
class Experts:
    """The expert layers' balance from their valid-token loads c_i (seeds 001 §7)."""

    layers: dict[str, ExpertBalance]  # layers that received a valid token, by label
    shard: float | None  # the largest expert-parallel shard imbalance over the layers

    @property
    def worst(self) -> tuple[str, ExpertBalance] | None:
        """The layer with the largest MaxVio (ties: the first layer in label order)."""
        found = None
        for layer, balance in self.layers.items():
            if found is None or balance.max_violation > found[1].max_violation:
                found = (layer, balance)
        return found


@dataclass(frozen=True, slots=True)
class Branch:
    """One residual branch's token means: R_b, with its N_s and N_b."""

    ratio: float
    layer: str
    branch: str  # attn | mlp
    tokens: float
    stream_norm: float | None
    branch_norm: float | None

    @property
    def where(self) -> str:
        return f"layer {self.layer} {self.branch}"


def _shards(labelled: dict[int, int], n_experts: int, ep_size: int) -> list[int] | None:
    """Each expert's shard: its label where every expert of the layer carries one, else
    contiguous over ``ep_size`` shards; None when there is no expert parallelism to read (or
    labels that do not name shards 0..S-1)."""
    if labelled:
        used = sorted(set(labelled.values()))
        whole = len(labelled) == n_experts and len(used) > 1 and used == list(range(len(used)))
        return [labelled[i] for i in range(n_experts)] if whole else None
    if ep_size > 1 and n_experts % ep_size == 0:
        per = n_experts // ep_size
        return [i // per for i in range(n_experts)]
    return None


class StepInputs:
    """One reduced step's components for the registry's formulas, each read once."""

    def __init__(
        self,
        item: ReducedStep,
        names: dict[str, dict[Labels, float]] | None = None,
        reads: RankReads | None = None,
    ) -> None:
        self.item = item
        self.red = item.reduced
        self.names = by_name(item.reduced) if names is None else names
        self.reads = rank_reads(item) if reads is None else reads
        self._grad: dict[Labels, GradStats | None] = {}

    # -- components ---------------------------------------------------------------------
    def get(self, name: str, **labels: str) -> float | None:
        """The reduced value of ``name`` with exactly ``labels`` (None: not measured)."""
        return self.red.get((name, tuple(sorted(labels.items()))))

    def total(self, name: str) -> float | None:
        """Σ of ``name`` over all its label sets (layers, depths, ...); None when absent."""
        found = self.names.get(name)
        return math.fsum(found.values()) if found else None

    def labelled(self, name: str) -> dict[Labels, float]:
        """``name``'s values that carry labels."""
        return {labels: v for labels, v in self.names.get(name, {}).items() if labels}

    def per_rank(self, name: str) -> dict[int, float]:
        """``name``'s unlabelled value per rank that reported it."""
        return self.reads.get(name, {}).get((), {})

    @cached_property
    def tokens(self) -> float:
        """N_tok: the step's valid tokens (0 when no rank had one)."""
        return self.get(Loss.TOKENS) or 0.0

    # -- shared intermediate results ------------------------------------------------------
    def grad_stats(self, **labels: str) -> GradStats | None:
        """G_mean, G_max, Z_g of all parameters, or of the group ``labels`` name."""
        key = tuple(sorted(labels.items()))
        if key not in self._grad:
            self._grad[key] = grad_stats(*(self.red.get((n, key)) for n in _GRAD))
        return self._grad[key]

    @cached_property
    def waits(self) -> dict[int, list[float]]:
        """The exposed collective waits (``comm.wait_s``, one per op) of each rank."""
        waits: dict[int, list[float]] = {}
        for by_rank in self.reads.get(Comm.WAIT, {}).values():
            for rank, value in by_rank.items():
                waits.setdefault(rank, []).append(value)
        return waits

    @cached_property
    def worst(self) -> Worst:
        sums, counts = self.per_rank(Loss.SUM), self.per_rank(Loss.TOKENS)
        ranks = sorted(set(sums) & set(counts))
        found = worst_rank_loss([sums[r] for r in ranks], [counts[r] for r in ranks])
        return Worst(None, None) if found is None else Worst(found[0], ranks[found[1]])

    @cached_property
    def own(self) -> dict[int, float]:
        """Each rank's own time: its step time less its exposed wait (finite waits summed)."""
        waits = {r: math.fsum(w for w in ws if math.isfinite(w)) for r, ws in self.waits.items()}
        return own_times(self.per_rank(System.STEP_TIME), waits)

    @cached_property
    def own_ratios(self) -> dict[int, float]:
        return own_time_ratios(self.own)

    @cached_property
    def straggler(self) -> int | None:
        """The rank with the largest own time (ties: the lowest rank)."""
        return max(sorted(self.own), key=self.own.__getitem__) if self.own else None

    @cached_property
    def memory(self) -> dict[int, float]:
        """Each rank's peak device memory, else its peak host RSS."""
        return self.per_rank(Memory.PEAK_ALLOCATED) or self.per_rank(Memory.PEAK_RSS)

    @cached_property
    def capacity(self) -> dict[int, float]:
        """Each rank's memory capacity (memory.capacity: what its ``memory`` peak may reach)."""
        return self.per_rank(Memory.CAPACITY)

    @cached_property
    def experts(self) -> Experts:
        """Each layer's balance and the worst shard imbalance. An expert's shard is its
        ``shard`` label (the placement the ranks reported: contiguous or strided); a layer
        sent without shard labels is taken as contiguous over the ``ep`` coordinates."""
        by_layer: dict[str, dict[int, float]] = defaultdict(dict)
        shard_of: dict[str, dict[int, int]] = defaultdict(dict)
        for labels, count in self.labelled(Moe.EXPERT_TOKENS).items():
            lab = dict(labels)
            expert = int(lab[Label.EXPERT])
            by_layer[lab[Label.LAYER]][expert] = count
            if Label.SHARD in lab:
                shard_of[lab[Label.LAYER]][expert] = int(lab[Label.SHARD])
        ep = Group.EXPERT.value
        coords = self.item.coords
        ep_size = len({r.get(ep, 0) for r in coords.values()}) if coords else 1
        layers: dict[str, ExpertBalance] = {}
        shard: float | None = None
        for layer, by_expert in sorted(by_layer.items()):
            counts = [by_expert.get(i, 0.0) for i in range(max(by_expert) + 1)]
            balance = expert_balance(counts)
            if balance is None:  # no valid token reached the layer: no measurement
                continue
            layers[layer] = balance
            owners = _shards(shard_of[layer], len(counts), ep_size)
            found = None if owners is None else shard_imbalance(counts, owners)
            if found is not None:
                shard = max(shard or 0.0, found)
        return Experts(layers, shard)

    @cached_property
    def expert_loads(self) -> list[list[float]]:
        """Each expert layer's loads c_i by expert index (layers with or without tokens)."""
        layers: dict[str, dict[int, float]] = {}
        for labels, v in self.names.get(Moe.EXPERT_TOKENS, {}).items():
            lab = dict(labels)
            layers.setdefault(lab[Label.LAYER], {})[int(lab[Label.EXPERT])] = v
        return [[by.get(i, 0.0) for i in range(max(by) + 1)] for by in layers.values()]

    @cached_property
    def branches(self) -> list[Branch]:
        """Each residual branch's token means (R_b, N_s, N_b) over Σ tokens, in label order:
        the layers and branches with valid tokens and a finite ratio sum (seeds 001 §8)."""
        out = []
        for labels, n in sorted(self.labelled(Residual.TOKENS).items()):
            ratio = self.red.get((_RATIO_SUM, labels))
            if not n > 0 or ratio is None or not math.isfinite(ratio):
                continue
            mean = mean_from_components(ratio, n)
            s, b = (self.red.get((name, labels)) for name in (_STREAM_NORM_SUM, _BRANCH_NORM_SUM))
            lab = dict(labels)
            out.append(
                Branch(
                    mean if mean is not None else math.nan,
                    lab.get(Label.LAYER, "?"),
                    lab.get(Label.BRANCH, "?"),
                    n,
                    None if s is None else mean_from_components(s, n),
                    None if b is None else mean_from_components(b, n),
                )
            )
        return out

    @cached_property
    def weakest_branch(self) -> Branch | None:
        """The branch with the smallest token-mean R_b (ties: the first in label order)."""
        weakest = None
        for branch in self.branches:
            if weakest is None or branch.ratio < weakest.ratio:
                weakest = branch
        return weakest

    @cached_property
    def rho_spread(self) -> Spread | None:
        """Min, median and max of the per-tensor update ratios, with the extreme tensors."""
        return spread(self.update_ratios)

    @cached_property
    def update_ratios(self) -> dict[str, float]:
        """ρ of each tensor scanned both as kind=param and kind=update at this step."""
        by_kind = self.tensor_sum_sq
        both = sorted(set(by_kind["param"]) & set(by_kind["update"]))
        found = {t: update_ratio(by_kind["update"][t], by_kind["param"][t]) for t in both}
        return {t: v for t, v in found.items() if v is not None}

    @cached_property
    def learning_rates(self) -> dict[str, float]:
        """η per parameter group (label param_group; its name, else its index)."""
        return {
            dict(labels).get(Label.PARAM_GROUP, ""): v
            for labels, v in self.labelled(Optim.LR).items()
        }

    @cached_property
    def tensor_sum_sq(self) -> dict[str, dict[str, float]]:
        """Σ x² per tensor of the kinds ``param`` and ``update`` scanned at this step."""
        by_kind: dict[str, dict[str, float]] = {"param": {}, "update": {}}
        for labels, v in self.names.get(Tensor.SUM_SQ, {}).items():
            lab = dict(labels)
            if lab.get(Label.KIND) in by_kind:
                by_kind[lab[Label.KIND]][lab.get(Label.TENSOR, "")] = v
        return by_kind
