"""The registry of stored series: one declaration per ``step_metrics`` column.

The catalog (``instrument.catalog``) is the wire contract: what a rank sends. This registry
is its counterpart on the stored side: for each column, its name, ClickHouse type, unit,
meaning, the catalog components it is formed from, the pure formula (``derive``) that forms
it, the migration that added it, its chart and whether the first screen shows it. What is
built from it:

* ``sinks.schema``: the ``step_metrics`` DDL, each later migration's ``ADD COLUMN`` (a row
  with ``since=N`` above the last written migration is migration N by itself) and the
  ``first_screen`` view;
* ``stream.view``: stage 2's view of a step, ``{s: s.formula(inputs) for s in VIEW}``;
* ``deploy.report``: one chart list (``CHARTS``) for the interactive page and the PNG;
* ``instrument``-free docs: the seed map and the README metric table (``deploy.seedmap``).

A column is a ``Series``, which *is* its name (a ``str``), so rules write
``view[StepMetrics.grad_norm]`` and a typo fails at import or in the type checker, never
in a stored row. Torch-free.

Adding an every-step series: a row here (with ``since`` = the next migration version), its
formula in ``derive`` if it is new arithmetic, and ``probewire migrate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from probewire.instrument.catalog import (
    Attn,
    Comm,
    Grad,
    Guard,
    Label,
    Loss,
    Memory,
    Modality,
    Moe,
    Net,
    Optim,
    Output,
    Residual,
    System,
    Tensor,
    Tier,
    tier_of,
)

from . import derive
from .inputs import StepInputs
from .records import CompleteReason

__all__ = [
    "CHARTS",
    "FORMED",
    "GUARD_STEP",
    "VIEW",
    "Axis",
    "Chart",
    "GradGroupStats",
    "Kind",
    "Series",
    "StepMetrics",
    "chart_columns",
    "step_series",
]


class Kind(StrEnum):
    """Who fills a column."""

    KEY = "key"  # the row's key: run and step
    VIEW = "view"  # formed from the step's components by its formula (the P0 view)
    FORMED = "formed"  # the seeds' further series, formed the same way (seed map: formed)
    TOTAL = "total"  # a running total stage 2 keeps across the run's steps
    DETECTOR = "detector"  # written by the detectors (scores, flags, counts)


class Axis(StrEnum):
    """How a chart draws its y values."""

    LINEAR = "linear"
    LOG = "log"
    COUNT = "count"  # a cumulative count: from 0, integer ticks, never smoothed
    SETTING = "setting"  # a value the loop sets (the learning rate): never smoothed


@dataclass(frozen=True, slots=True)
class Chart:
    """One chart of the reports: its series are the registry rows naming it.

    ``signals`` are the anomaly signals marked on it. ``panel`` is the key of the PNG
    first-screen panel the chart belongs to (itself for the nine panels, another chart's key
    to be drawn on that panel's right axis, None for the interactive page only);
    ``panel_title`` is a panel's title in the PNG; ``right`` draws a chart that belongs to
    another's panel on that panel's right axis (else only its anomalies are marked there).
    """

    key: str
    title: str
    unit: str
    axis: Axis = Axis.LINEAR
    signals: frozenset[str] = frozenset()
    scale: float = 1.0
    panel: str | None = None
    panel_title: str = ""
    right: bool = False  # PNG: drawn on the right axis of its panel (else marks only)

    @property
    def log(self) -> bool:
        return self.axis is Axis.LOG

    @property
    def smooth(self) -> bool:
        """Whether smoothing may apply: never to counts or to what the loop sets."""
        return self.axis not in (Axis.COUNT, Axis.SETTING)


_GIB = float(1 << 30)

CHARTS: tuple[Chart, ...] = (
    Chart(
        "loss",
        "Loss: mean L and worst rank L_max",
        "nats/token",
        signals=frozenset({"loss", "loss_worst_rank"}),
        panel="loss",
        panel_title="Loss: mean L and worst rank L_max",
    ),
    Chart(
        "source",
        "Loss by source (share of the run's tokens)",
        "nats/token",
        signals=frozenset({"loss_by_source"}),
        panel="source",
        panel_title="Loss by source (own history)",
    ),
    Chart("lr", "Learning rate", "lr (largest group)", Axis.SETTING),
    Chart(
        "grad",
        "Gradient norm G2 (pre-clip)",
        "G2 (L2 norm)",
        Axis.LOG,
        frozenset({"grad_norm"}),
        panel="grad",
        panel_title="Gradient norm G2 and clip rate",
    ),
    Chart(
        "clip",
        "Clip rate",
        "fraction of steps",
        signals=frozenset({"clip_rate"}),
        panel="grad",
        right=True,
    ),
    Chart(
        "cospike",
        "Co-spikes (cumulative)",
        "count",
        Axis.COUNT,
        frozenset({"cospike"}),
        panel="cospike",
        panel_title="Co-spikes (cumulative)",
    ),
    Chart(
        "eval",
        "Evaluations",
        "value (bpb: bits/byte)",
        signals=frozenset({"bpb"}),
        panel="eval",
        panel_title="Held-out bits per byte",
    ),
    Chart(
        "time",
        "System: step time",
        "s",
        signals=frozenset({"step_time", "step_time_s", "straggler_score"}),
        panel="time",
        panel_title="Step time and throughput",
    ),
    Chart(
        "throughput",
        "System: throughput",
        "tokens/s",
        signals=frozenset({"tokens_per_s"}),
        panel="time",
        right=True,
    ),
    Chart(
        "compute", "System: compute rate per device", "FLOP/s", signals=frozenset({"compute_rate"})
    ),
    Chart(
        "memory",
        "System: peak memory, max over ranks",
        "GiB",
        signals=frozenset({"peak_memory", "peak_memory_bytes"}),
        scale=_GIB,
        panel="memory",
        panel_title="Peak memory, max over ranks",
    ),
    Chart(
        "experts",
        "Expert balance: MaxVio (worst layer, mean over layers)",
        "ratio (MaxVio = I - 1)",
        signals=frozenset({"moe_maxvio", "moe_shard_imbalance", "moe_h_norm"}),
        panel="experts",
        panel_title="Expert balance: MaxVio",
    ),
    Chart(
        "output",
        "Output |x|max",
        "logit (|x|max)",
        Axis.LOG,
        frozenset({"output_absmax"}),
        panel="output",
        panel_title="Output |x|max",
    ),
)
_CHART_KEYS = frozenset(c.key for c in CHARTS)

Formula = Callable[..., Any]  # (StepInputs) -> value; group rows also take the group's labels


class Series(str):
    """One stored column: the string is its name; the rest is its declaration.

    ``components`` are the catalog names it is formed from (its cadence is theirs);
    ``formula`` forms it from a step's ``StepInputs`` (VIEW and FORMED rows only);
    ``since`` is the schema migration that added it; ``chart`` and ``label`` place it in
    the reports; ``first_screen`` puts it in the ``first_screen`` view; ``seed`` cites the
    definition (docs/metrics.md).
    """

    sql: str
    doc: str
    unit: str
    kind: Kind
    components: tuple[str, ...]
    formula: Formula | None
    default: str | None
    since: int
    chart: str | None
    label: str
    first_screen: bool
    seed: str

    def __new__(
        cls,
        name: str,
        sql: str,
        doc: str = "",
        *,
        unit: str = "",
        kind: Kind = Kind.VIEW,
        components: tuple[str, ...] = (),
        formula: Formula | None = None,
        default: str | None = None,
        since: int = 1,
        chart: str | None = None,
        label: str = "",
        first_screen: bool = False,
        seed: str = "",
    ) -> Series:
        if kind in (Kind.VIEW, Kind.FORMED) and formula is None:
            raise ValueError(f"series {name}: a {kind} series needs its formula")
        if chart is not None and chart not in _CHART_KEYS:
            raise ValueError(f"series {name}: no chart {chart!r} in CHARTS")
        self = super().__new__(cls, name)
        self.sql, self.doc, self.unit, self.kind = sql, doc, unit, kind
        self.components, self.formula, self.since = components, formula, since
        self.default = "NULL" if default is None and sql.startswith("Nullable") else default
        self.chart, self.label, self.first_screen, self.seed = (
            chart,
            label or name,
            first_screen,
            seed,
        )
        return self

    @property
    def name(self) -> str:
        return str.__str__(self)

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return str, (self.name,)  # pickled (or copied) it is its name

    @property
    def tier(self) -> Tier:
        """The cadence: its components' catalog tier (it exists on the steps that measure them)."""
        return tier_of(*self.components)


def _f(name: str, doc: str, **spec: Any) -> Series:
    """A measurement that may be absent: NULL means not measured, never zero."""
    return Series(name, "Nullable(Float64)", doc, **spec)


def _largest_lr(s: StepInputs) -> float | None:
    """The largest finite learning rate over the groups (else the first group's value)."""
    groups = s.learning_rates
    finite = [v for v in groups.values() if math.isfinite(v)]
    return max(finite) if finite else (next(iter(groups.values())) if groups else None)


def _grad(field_: str) -> Callable[..., float | None]:
    """G_mean, G_max or Z_g (``derive.grad_stats``) of all parameters, or of the parameter
    group a label set names (``grad_group_stats``)."""

    def formula(s: StepInputs, **labels: str) -> float | None:
        stats = s.grad_stats(**labels)
        return None if stats is None else getattr(stats, field_)

    return formula


def _update_ratio(s: StepInputs) -> float | None:
    """ρ over the tensors scanned both as kind=param and kind=update at this step."""
    by_kind = s.tensor_sum_sq
    both = sorted(set(by_kind["param"]) & set(by_kind["update"]))
    if not both:
        return None
    return derive.update_ratio(
        math.fsum(by_kind["update"][t] for t in both), math.fsum(by_kind["param"][t] for t in both)
    )


def _bos(s: StepInputs) -> float | None:
    return derive.rms_from_components(s.total(Attn.BOS_SUM_SQ) or 0.0, s.total(Attn.BOS_N) or 0.0)


def _bos_ratio(s: StepInputs) -> float | None:
    other = derive.rms_from_components(
        s.total(Attn.VALUE_SUM_SQ) or 0.0, s.total(Attn.VALUE_N) or 0.0
    )
    return derive.ratio_from_components(_bos(s), other)


def _logits_rms(s: StepInputs) -> float | None:
    sum_sq, n = s.get(Output.LOGITS_SUM_SQ), s.get(Output.LOGITS_N)
    return None if sum_sq is None or n is None else derive.rms_from_components(sum_sq, n)


def _worst_expert(s: StepInputs) -> float | None:
    worst = s.experts.worst
    return None if worst is None else worst[1].max_violation


def _lowest_entropy(s: StepInputs) -> float | None:
    found = [b.entropy_norm for b in s.experts.layers.values() if b.entropy_norm is not None]
    return min(found) if found else None


_G = (Grad.ABS_SUM, Grad.ABS_MAX, Grad.ZEROS, Grad.ELEMENTS, Grad.NONFINITE)
_TOP2 = (Output.POSITIONS, Output.TOP2_GAP_SUM, Output.TOP2_EQUAL)
_BOS = (Attn.BOS_SUM_SQ, Attn.BOS_N)
_LOSS = (Loss.SUM, Loss.TOKENS)
_TIME = (System.STEP_TIME,)
_MEDIA = (Modality.MEDIA_SUM_SQ, Modality.MEDIA_N, Modality.TEXT_SUM_SQ, Modality.TEXT_N)
_RESIDUAL = (
    Residual.TOKENS,
    *(Residual.name(s, "sum") for s in ("ratio", "stream_norm", "branch_norm")),
)
_STATUS = "Nullable(UInt32)"


class StepMetrics:
    """``step_metrics``: every step, unsmoothed, in column order (the table's DDL order)."""

    run_id = Series("run_id", "LowCardinality(String)", kind=Kind.KEY, first_screen=True)
    step = Series("step", "UInt64", "optimizer step", kind=Kind.KEY, first_screen=True)
    tokens = Series(
        "tokens",
        "UInt64",
        "cumulative valid tokens through this step",
        kind=Kind.TOTAL,
        unit="tokens",
        first_screen=True,
    )
    flops = Series(
        "flops",
        "Float64",
        "cumulative estimated FLOPs through this step",
        kind=Kind.TOTAL,
        default="0",
        unit="FLOP",
        first_screen=True,
    )
    step_tokens = Series(
        "step_tokens",
        "UInt64",
        "valid tokens of this step (N_tok)",
        default="0",
        unit="tokens",
        components=_LOSS,
        formula=lambda s: int(s.tokens),
        seed="001 §5",
    )
    loss = _f(
        "loss",
        "L = sum of loss sums / sum of valid tokens over ranks",
        unit="nats/token",
        components=_LOSS,
        formula=lambda s: derive.global_mean_loss([s.get(Loss.SUM) or 0.0], [s.tokens]),
        chart="loss",
        label="L",
        first_screen=True,
        seed="001 §3",
    )
    loss_worst_rank = _f(
        "loss_worst_rank",
        "L_max: the largest per-rank mean loss",
        unit="nats/token",
        components=_LOSS,
        formula=lambda s: s.worst.loss,
        chart="loss",
        label="L_max",
        first_screen=True,
        seed="001 §3",
    )
    loss_worst_rank_id = Series(
        "loss_worst_rank_id",
        _STATUS,
        "the rank holding L_max",
        components=_LOSS,
        formula=lambda s: s.worst.rank,
        first_screen=True,
        seed="001 §3",
    )
    grad_norm = _f(
        "grad_norm",
        "G2 before clipping",
        unit="L2 norm",
        components=(Grad.NORM_SQ,),
        formula=lambda s: derive.norm_from_squares(s.get(Grad.NORM_SQ)),
        chart="grad",
        label="G2",
        first_screen=True,
        seed="001 §4",
    )
    clip_rate = _f(
        "clip_rate",
        "fraction of the recent window of steps with G2 above the clip threshold",
        kind=Kind.DETECTOR,
        unit="fraction of steps",
        chart="clip",
        label="clip rate",
        first_screen=True,
        seed="001 §4",
    )
    clipped = Series(
        "clipped",
        "UInt8",
        "1 when G2 exceeded the clip threshold at this step",
        default="0",
        components=(Grad.CLIPPED,),
        formula=lambda s: s.get(Grad.CLIPPED),  # the loop's own verdict; the detector decides
        seed="001 §4",
    )
    loss_z = _f("loss_z", "robust spike score of the loss", kind=Kind.DETECTOR, seed="001 §4")
    grad_z = _f("grad_z", "robust spike score of G2", kind=Kind.DETECTOR, seed="001 §4")
    loss_spike = Series("loss_spike", "UInt8", kind=Kind.DETECTOR, default="0")
    grad_spike = Series("grad_spike", "UInt8", kind=Kind.DETECTOR, default="0")
    cospike = Series(
        "cospike",
        "UInt8",
        "loss and G2 spiked at this step",
        kind=Kind.DETECTOR,
        default="0",
        first_screen=True,
    )
    cospike_count = Series(
        "cospike_count",
        "UInt64",
        "cumulative co-spikes",
        kind=Kind.DETECTOR,
        default="0",
        unit="count",
        chart="cospike",
        label="co-spikes",
        first_screen=True,
        seed="001 §4",
    )
    cospike_magnitude = Series(
        "cospike_magnitude",
        "Float64",
        "cumulative co-spike magnitude",
        kind=Kind.DETECTOR,
        default="0",
        seed="001 §4",
    )
    step_time_s = _f(
        "step_time_s",
        "tau = max over ranks of the local step time",
        unit="s",
        components=_TIME,
        formula=lambda s: s.get(System.STEP_TIME),
        chart="time",
        label="step time",
        first_screen=True,
        seed="001 §5",
    )
    tokens_per_s = _f(
        "tokens_per_s",
        "N_tok / tau",
        unit="tokens/s",
        components=(*_LOSS, *_TIME),
        formula=lambda s: derive.token_rate(s.tokens, s.get(System.STEP_TIME)),
        chart="throughput",
        label="tokens/s",
        first_screen=True,
        seed="001 §5",
    )
    compute_rate = _f(
        "compute_rate",
        "Phi: estimated FLOP/s per device",
        unit="FLOP/s",
        components=(System.FLOPS, *_TIME),
        formula=lambda s: derive.compute_rate(
            s.get(System.FLOPS), s.item.world_size, s.get(System.STEP_TIME)
        ),
        chart="compute",
        label="Phi",
        first_screen=True,
        seed="001 §5",
    )
    straggler_score = _f(
        "straggler_score",
        "S = tau / median local step time",
        components=_TIME,
        formula=lambda s: (
            derive.straggler_score(list(t.values()))
            if (t := s.per_rank(System.STEP_TIME))
            else None
        ),
        first_screen=True,
        seed="001 §5",
    )
    straggler_rank = Series(
        "straggler_rank",
        _STATUS,
        "the slowest rank: the largest own time",
        components=(*_TIME, Comm.WAIT),
        formula=lambda s: s.straggler,
        first_screen=True,
        seed="001 §5",
    )
    peak_memory_bytes = _f(
        "peak_memory_bytes",
        "peak device memory, max over ranks",
        unit="bytes",
        components=(Memory.PEAK_ALLOCATED,),
        formula=lambda s: max(s.memory.values()) if s.memory else None,
        chart="memory",
        label="peak",
        first_screen=True,
        seed="001 §5",
    )
    peak_memory_rank = Series(
        "peak_memory_rank",
        _STATUS,
        "the rank with the peak",
        components=(Memory.PEAK_ALLOCATED,),
        formula=lambda s: max(s.memory, key=s.memory.__getitem__) if s.memory else None,
        first_screen=True,
        seed="001 §5",
    )
    moe_maxvio = _f(
        "moe_maxvio",
        "expert MaxVio = I - 1, worst layer",
        components=(Moe.EXPERT_TOKENS,),
        formula=_worst_expert,
        unit="ratio",
        chart="experts",
        label="MaxVio (worst layer)",
        first_screen=True,
        seed="001 §7",
    )
    moe_maxvio_mean = _f(
        "moe_maxvio_mean",
        "expert MaxVio = I - 1, mean over the MoE layers with tokens",
        since=7,
        components=(Moe.EXPERT_TOKENS,),
        formula=lambda s: derive.mean_max_violation(s.expert_loads),
        unit="ratio",
        chart="experts",
        label="MaxVio (mean over layers)",
        first_screen=True,
        seed="002 moe/maxvio.mean (.max)",
    )
    moe_shard_imbalance = _f(
        "moe_shard_imbalance",
        "expert-parallel shard imbalance, worst layer",
        components=(Moe.EXPERT_TOKENS,),
        formula=lambda s: s.experts.shard,
        first_screen=True,
        seed="001 §7",
    )
    moe_h_norm = _f(
        "moe_h_norm",
        "normalized routing entropy, lowest layer",
        components=(Moe.EXPERT_TOKENS,),
        formula=_lowest_entropy,
        seed="001 §7",
    )
    output_absmax = _f(
        "output_absmax",
        "absolute maximum of the model output",
        components=(Output.LOGITS_ABS_MAX,),
        formula=lambda s: s.get(Output.LOGITS_ABS_MAX),
        unit="logit",
        chart="output",
        label="|x|max",
        first_screen=True,
        seed="001 §6",
    )
    modality_token_share = Series(
        "modality_token_share",
        "Map(LowCardinality(String), Float64)",
        "pi per modality: its tokens entering the backbone / all modalities' tokens (empty "
        "without a media path)",
        since=8,
        default="map()",
        components=(Modality.TOKENS,),
        formula=lambda s: derive.shares(
            {dict(k).get(Label.MODALITY, ""): v for k, v in s.labelled(Modality.TOKENS).items()}
        ),
        first_screen=True,
        seed="001 §9 token share π",
    )
    # migration 2: structure P0 signals at their probe cadence, the straggler's own-time ratio
    media_scale = _f(
        "media_scale",
        "gamma = RMS of the media tokens / RMS of the text embeddings",
        since=2,
        components=_MEDIA,
        formula=lambda s: derive.media_scale(*(s.get(n) for n in _MEDIA)),
        seed="001 §9",
    )
    residual_ratio_min = _f(
        "residual_ratio_min",
        "R_b of the weakest residual branch (token mean)",
        since=2,
        components=_RESIDUAL,
        formula=lambda s: None if (b := s.weakest_branch) is None else b.ratio,
        seed="001 §8",
    )
    residual_ratio_branch = Series(
        "residual_ratio_branch",
        "Nullable(String)",
        "the weakest branch: layer L attn|mlp",
        since=2,
        components=_RESIDUAL,
        formula=lambda s: None if (b := s.weakest_branch) is None else b.where,
        seed="001 §8",
    )
    residual_stream_norm = _f(
        "residual_stream_norm",
        "N_s at the weakest branch (token mean)",
        since=2,
        components=_RESIDUAL,
        formula=lambda s: None if (b := s.weakest_branch) is None else b.stream_norm,
        seed="001 §8",
    )
    residual_branch_norm = _f(
        "residual_branch_norm",
        "N_b of the weakest branch (token mean)",
        since=2,
        components=_RESIDUAL,
        formula=lambda s: None if (b := s.weakest_branch) is None else b.branch_norm,
        seed="001 §8",
    )
    straggler_own_ratio = _f(
        "straggler_own_ratio",
        "own time of straggler_rank / median own time of the other ranks (own time = local "
        "step time - its collective wait)",
        since=2,
        components=(*_TIME, Comm.WAIT),
        formula=lambda s: None if s.straggler is None else s.own_ratios.get(s.straggler),
        seed="001 §5",
    )
    # migration 3: the learning rates of the step's update
    lr = _f(
        "lr",
        "learning rate: the largest over the optimizer's parameter groups",
        since=3,
        unit="lr",
        components=(Optim.LR,),
        formula=_largest_lr,
        chart="lr",
        label="lr",
        first_screen=True,
        seed="001 §6",
    )
    lr_groups = Series(
        "lr_groups",
        "Map(LowCardinality(String), Float64)",
        "learning rate per parameter group (its name, else its index)",
        since=3,
        default="map()",
        components=(Optim.LR,),
        formula=lambda s: s.learning_rates,
        seed="001 §6",
    )
    # migration 4 (issue 18): the seeds' further series at their components' cadence (NULL
    # on a step that does not measure them), and the spike guard's per-step events
    grad_abs_mean = _f(
        "grad_abs_mean",
        "G_mean = sum |g| / (P - non-finite), all parameters, before clipping",
        kind=Kind.FORMED,
        since=4,
        components=_G,
        formula=_grad("abs_mean"),
        seed="001 §4 mean absolute gradient G_mean",
    )
    grad_abs_max = _f(
        "grad_abs_max",
        "G_max = max |g| over finite gradient elements",
        kind=Kind.FORMED,
        since=4,
        components=_G,
        formula=_grad("abs_max"),
        seed="001 §4 maximum absolute gradient G_max",
    )
    grad_zero_frac = _f(
        "grad_zero_frac",
        "Z_g = exact zero gradient elements / P",
        kind=Kind.FORMED,
        since=4,
        components=_G,
        formula=_grad("zero_frac"),
        seed="001 §4 gradient zero fraction Z_g",
    )
    comm_wait_frac = _f(
        "comm_wait_frac",
        "W_comm = the largest rank exposed collective wait / tau",
        kind=Kind.FORMED,
        since=4,
        components=(Comm.WAIT, System.STEP_TIME),
        formula=lambda s: derive.comm_wait_frac(
            {r: math.fsum(ws) for r, ws in s.waits.items()}, s.get(System.STEP_TIME)
        ),
        seed="001 §5 exposed collective wait W_comm",
    )
    update_ratio = _f(
        "update_ratio",
        "rho pooled over the scanned tensors: ||all updates|| / ||all params|| (per tensor: "
        "update_ratio_min/median/max here, every tensor in the tensor_update_ratio view)",
        kind=Kind.FORMED,
        since=4,
        components=(Tensor.SUM_SQ,),
        formula=_update_ratio,
        seed="001 §6 relative update size ρ",
    )
    update_ratio_min = _f(
        "update_ratio_min",
        "rho of the tensor whose update is smallest against its weights",
        since=8,
        components=(Tensor.SUM_SQ,),
        formula=lambda s: None if (r := s.rho_spread) is None else r.min,
        seed="001 §6",
    )
    update_ratio_min_tensor = Series(
        "update_ratio_min_tensor",
        "Nullable(String)",
        "the tensor of update_ratio_min",
        since=8,
        components=(Tensor.SUM_SQ,),
        formula=lambda s: None if (r := s.rho_spread) is None else r.min_at,
        seed="001 §6",
    )
    update_ratio_median = _f(
        "update_ratio_median",
        "median over the scanned tensors of rho = ||dw|| / (||w|| + eps)",
        since=8,
        components=(Tensor.SUM_SQ,),
        formula=lambda s: None if (r := s.rho_spread) is None else r.median,
        seed="001 §6 relative update size ρ",
    )
    update_ratio_max = _f(
        "update_ratio_max",
        "rho of the tensor whose update is largest against its weights",
        since=8,
        components=(Tensor.SUM_SQ,),
        formula=lambda s: None if (r := s.rho_spread) is None else r.max,
        seed="001 §6",
    )
    update_ratio_max_tensor = Series(
        "update_ratio_max_tensor",
        "Nullable(String)",
        "the tensor of update_ratio_max",
        since=8,
        components=(Tensor.SUM_SQ,),
        formula=lambda s: None if (r := s.rho_spread) is None else r.max_at,
        seed="001 §6",
    )
    logits_rms = _f(
        "logits_rms",
        "RMS of the output logits over valid positions",
        kind=Kind.FORMED,
        since=4,
        components=(Output.LOGITS_SUM_SQ, Output.LOGITS_N),
        formula=_logits_rms,
        seed="002 act/output_layer_logits_rms.avg",
    )
    top2_gap_mean = _f(
        "top2_gap_mean",
        "mean top-1 minus top-2 logit over valid positions",
        kind=Kind.FORMED,
        since=4,
        components=_TOP2,
        formula=lambda s: derive.ratio_from_components(
            s.get(Output.TOP2_GAP_SUM), s.get(Output.POSITIONS)
        ),
        seed="002 act/output_layer_logits_top2_diff.avg",
    )
    top2_tie_frac = _f(
        "top2_tie_frac",
        "fraction of valid positions whose top-2 logits are equal",
        kind=Kind.FORMED,
        since=4,
        components=_TOP2,
        formula=lambda s: derive.ratio_from_components(
            s.get(Output.TOP2_EQUAL), s.get(Output.POSITIONS)
        ),
        seed="002 act/output_layer_logits_top2_equal_ratio",
    )
    dead_expert_ratio = _f(
        "dead_expert_ratio",
        "experts with no valid token / experts, MoE layers with tokens",
        kind=Kind.FORMED,
        since=4,
        components=(Moe.EXPERT_TOKENS,),
        formula=lambda s: derive.dead_expert_ratio(s.expert_loads),
        seed="002 moe/dead_expert_ratio",
    )
    encoder_grad_share = _f(
        "encoder_grad_share",
        "S_enc = ||g_encoder||^2 / ||g||^2",
        kind=Kind.FORMED,
        since=4,
        components=(Modality.ENCODER_GRAD_SQ, Modality.ALL_GRAD_SQ),
        formula=lambda s: derive.ratio_from_components(
            s.get(Modality.ENCODER_GRAD_SQ), s.get(Modality.ALL_GRAD_SQ)
        ),
        seed="001 §9 encoder gradient share S_enc",
    )
    mtp_agreement = _f(
        "mtp_agreement",
        "top-1 agreement of LM head and MTP heads, aligned positions, pooled over depths "
        "(per depth: mtp_agreement_by_depth)",
        kind=Kind.FORMED,
        since=4,
        components=(Output.MTP_AGREE, Output.MTP_POSITIONS),
        formula=lambda s: derive.ratio_from_components(
            s.total(Output.MTP_AGREE), s.total(Output.MTP_POSITIONS)
        ),
        seed="002 act/mtp_{k}_lm_head_top1_agreement",
    )
    mtp_agreement_by_depth = Series(
        "mtp_agreement_by_depth",
        "Map(LowCardinality(String), Float64)",
        "top-1 agreement of the LM head and the MTP head of each depth k, aligned positions",
        since=8,
        default="map()",
        components=(Output.MTP_AGREE, Output.MTP_POSITIONS),
        formula=lambda s: derive.ratios_by_label(
            s.labelled(Output.MTP_AGREE), s.labelled(Output.MTP_POSITIONS), Label.DEPTH
        ),
        seed="002 act/mtp_{k}_lm_head_top1_agreement",
    )
    bos_value_grad_rms = _f(
        "bos_value_grad_rms",
        "RMS of the attention value gradient at BOS positions",
        kind=Kind.FORMED,
        since=4,
        components=_BOS,
        formula=_bos,
        seed="002 bos_value_grad_...",
    )
    bos_value_grad_ratio = _f(
        "bos_value_grad_ratio",
        "BOS value-gradient RMS / the other positions RMS",
        kind=Kind.FORMED,
        since=4,
        components=(*_BOS, Attn.VALUE_SUM_SQ, Attn.VALUE_N),
        formula=_bos_ratio,
        seed="002 bos_value_grad_... (against the other positions)",
    )
    ep_bias_abs_sum = _f(
        "ep_bias_abs_sum",
        "sum over MoE layers of sum |expert selection bias|",
        kind=Kind.FORMED,
        since=4,
        components=(Moe.BIAS_ABS_SUM,),
        formula=lambda s: s.total(Moe.BIAS_ABS_SUM),
        seed="002 moe/ep_bias_abs_sum",
    )
    skipped_step = Series(
        "skipped_step",
        "UInt8",
        "updates the spike guard skipped in this step",
        since=4,
        default="0",
        components=(Guard.SKIPPED,),
        formula=lambda s: int(s.get(Guard.SKIPPED) or 0),
        seed="001 §4",
    )
    replayed_step = Series(
        "replayed_step",
        "UInt8",
        "replays of this step",
        since=4,
        default="0",
        components=(Guard.REPLAYED,),
        formula=lambda s: int(s.get(Guard.REPLAYED) or 0),
        seed="001 §4",
    )
    replay_mismatch_step = Series(
        "replay_mismatch_step",
        "UInt8",
        "replays of this step that did not reproduce",
        since=4,
        default="0",
        components=(Guard.REPLAY_MISMATCH,),
        formula=lambda s: int(s.get(Guard.REPLAY_MISMATCH) or 0),
        seed="001 §4",
    )
    skipped = Series(
        "skipped",
        "UInt32",
        "updates skipped by the spike guard, cumulative",
        kind=Kind.TOTAL,
        default="0",
        seed="001 §4",
    )
    replayed = Series(
        "replayed",
        "UInt32",
        "replayed steps, cumulative",
        kind=Kind.TOTAL,
        default="0",
        seed="001 §4",
    )
    replay_mismatch = Series(
        "replay_mismatch",
        "UInt32",
        "replays that did not reproduce the loss, cumulative",
        kind=Kind.TOTAL,
        default="0",
        seed="001 §4",
    )
    ranks_reporting = Series(
        "ranks_reporting",
        "UInt32",
        default="0",
        formula=lambda s: len(s.item.ranks_reporting),
    )
    ranks_missing = Series(
        "ranks_missing", "Array(UInt32)", default="[]", formula=lambda s: list(s.item.ranks_missing)
    )
    complete_reason = Series(
        "complete_reason",
        "LowCardinality(String)",
        "why the step was emitted: " + ", ".join(r.value for r in CompleteReason),
        default="''",
        formula=lambda s: s.item.complete_reason,
    )
    warmup = Series(
        "warmup", "UInt8", "1 while the spike detectors warm up", kind=Kind.DETECTOR, default="0"
    )
    memory_capacity_bytes = _f(
        "memory_capacity_bytes",
        "memory capacity, the smallest over ranks (device total; CPU: cgroup or system limit)",
        since=8,
        unit="bytes",
        components=(Memory.CAPACITY,),
        formula=lambda s: s.get(Memory.CAPACITY),
        seed="001 §5 peak memory, max over ranks",
    )
    memory_headroom = _f(
        "memory_headroom",
        "1 - peak / capacity of the worst rank: min over ranks of 1 - peak_r / capacity_r",
        since=8,
        components=(Memory.PEAK_ALLOCATED, Memory.PEAK_RSS, Memory.CAPACITY),
        formula=lambda s: derive.memory_headroom(s.memory, s.capacity),
        seed="001 §5 peak memory, max over ranks",
    )
    # migration 9 (issue 38): what the detectors audit
    grad_clip_norm = _f(
        "grad_clip_norm",
        "the global gradient norm the loop reported clipping with (s.clipped(total_norm)), "
        "as it computed it; NULL when it clipped through the monitor (that norm is G2)",
        since=9,
        unit="L2 norm",
        components=(Grad.CLIP_NORM,),
        formula=lambda s: s.get(Grad.CLIP_NORM),
        seed="001 §4",
    )
    net_rx_bytes = _f(
        "net_rx_bytes",
        "bytes the nodes received since their previous sample, summed over nodes (read by "
        "the local rank 0 of each node)",
        since=11,
        unit="bytes",
        components=(Net.RX,),
        formula=lambda s: s.get(Net.RX),
        seed="001 §5 network counters read once per node",
    )
    net_tx_bytes = _f(
        "net_tx_bytes",
        "bytes the nodes sent since their previous sample, summed over nodes",
        since=11,
        unit="bytes",
        components=(Net.TX,),
        formula=lambda s: s.get(Net.TX),
        seed="001 §5 network counters read once per node",
    )


def step_series() -> tuple[Series, ...]:
    """Every ``step_metrics`` column in table order."""
    return tuple(v for v in vars(StepMetrics).values() if isinstance(v, Series))


def _check(rows: tuple[Series, ...]) -> tuple[Series, ...]:
    for name, value in vars(StepMetrics).items():
        if isinstance(value, Series) and value != name:
            raise ValueError(f"StepMetrics.{name} declares the column {value!r}")
    return rows


STEP_SERIES: tuple[Series, ...] = _check(step_series())
VIEW: tuple[Series, ...] = tuple(s for s in STEP_SERIES if s.formula is not None)
"""The columns stage 2's view forms from a step's components, in table order."""

GUARD_STEP = {
    Guard.SKIPPED: StepMetrics.skipped_step,
    Guard.REPLAYED: StepMetrics.replayed_step,
    Guard.REPLAY_MISMATCH: StepMetrics.replay_mismatch_step,
}
"""The spike guard's events of this step, by the view column holding them; stage 2 keeps
their cumulative counts (``skipped``, ``replayed``, ``replay_mismatch``) in its state."""

GUARD_TOTAL = {
    StepMetrics.skipped_step: StepMetrics.skipped,
    StepMetrics.replayed_step: StepMetrics.replayed,
    StepMetrics.replay_mismatch_step: StepMetrics.replay_mismatch,
}


class GradGroupStats:
    """``grad_group_stats``: G_mean, G_max, Z_g of one parameter group at every step."""

    grad_abs_mean = _f(
        "grad_abs_mean",
        "sum |g| / (P - non-finite)",
        kind=Kind.FORMED,
        since=4,
        components=_G,
        formula=_grad("abs_mean"),
        seed="001 §4 G_mean per group (embeddings, experts apart)",
    )
    grad_abs_max = _f(
        "grad_abs_max",
        "max |g| over finite elements",
        kind=Kind.FORMED,
        since=4,
        components=_G,
        formula=_grad("abs_max"),
        seed="001 §4 G_max per group",
    )
    grad_zero_frac = _f(
        "grad_zero_frac",
        "exact zeros / P",
        kind=Kind.FORMED,
        since=4,
        components=_G,
        formula=_grad("zero_frac"),
        seed="001 §4 Z_g per group",
    )


@dataclass(frozen=True, slots=True)
class Formed:
    """A formed series by its table (the seed map's and the demo test's view of the registry)."""

    table: str
    column: str
    components: tuple[str, ...]
    seed: str
    series: Series = field(repr=False, compare=False)

    @property
    def tier(self) -> Tier:
        return tier_of(*self.components)


FORMED: tuple[Formed, ...] = tuple(
    Formed(table, s, s.components, s.seed, s)
    for table, rows in (
        ("step_metrics", STEP_SERIES),
        (
            "grad_group_stats",
            tuple(v for v in vars(GradGroupStats).values() if isinstance(v, Series)),
        ),
    )
    for s in rows
    if s.kind is Kind.FORMED
)
"""The seeds' further series (issue 18), by table."""


def chart_columns(chart: Chart) -> tuple[tuple[str, str], ...]:
    """The (column, legend label) pairs a chart draws, in table order."""
    return tuple((s.name, s.label) for s in STEP_SERIES if s.chart == chart.key)
