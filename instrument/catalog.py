"""The metric catalog: the wire contract between training ranks and the stream.

Each metric a rank emits is written here once: its name (units in the name), priority,
default cadence, the cross-rank reduction the stream applies, its unit, its bounded
labels, where it is measured, and which parallel groups hold identical copies of it.
Torch-free: the stream, the sink and the docs import it without a training stack.

Ranks send reducible *components* (sums, counts, maxima), never means or ratios; the
stream forms L, L_max, G2, ... from them (seeds 001 §3-§6, "distributed reduction").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Mapping

__all__ = ["CATALOG", "Group", "MetricSpec", "Priority", "Reduction", "spec"]


class Priority(StrEnum):
    """P0 pages someone; P1 is opened when a P0 moves; P2 is for one investigation (§0)."""

    P0 = "P0"
    P1 = "P1"
    P2 = "P2"


class Reduction(StrEnum):
    """How the stream combines one metric's per-rank components into one step value."""

    SUM = "sum"          # numerators and counts: summed, then divided downstream
    MAX = "max"          # maxima over ranks (never averaged)
    MIN = "min"
    MEDIAN = "median"    # median over ranks, where the definition asks for it
    PER_RANK = "per_rank"  # kept per rank; the stream reduces nothing


class Group(StrEnum):
    """Parallel groups a rank belongs to; its coordinate in each is sent with every message."""

    DATA = "dp"
    TENSOR = "tp"
    PIPELINE = "pp"
    CONTEXT = "cp"
    EXPERT = "ep"


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One metric's definition.

    ``replicated_over`` lists the groups across which ranks hold identical values (an
    all-reduced gradient is identical on every data-parallel rank; the loss is identical on
    every tensor-parallel rank). The stream keeps one representative per replica class
    before applying ``reduction`` over the remaining ranks, so nothing is counted twice.
    """

    name: str
    priority: Priority
    cadence_steps: int          # 1 = every step; 100 = every 100th step; 0 = on demand
    reduction: Reduction
    unit: str
    point: str                  # where and when it is measured
    doc: str                    # formula and meaning
    seed: str                   # citation into ../shared/seeds
    labels: tuple[str, ...] = ()
    replicated_over: frozenset[Group] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if self.cadence_steps < 0:
            raise ValueError(f"{self.name}: cadence_steps must be >= 0")
        if not self.name or self.name != self.name.strip():
            raise ValueError(f"bad metric name {self.name!r}")


_GRAD_POINT = ("global gradient after accumulation over micro-batches and loss-scale removal, "
               "before clipping; one value per optimizer step")

_SPECS = (
    MetricSpec(
        name="loss.sum", priority=Priority.P0, cadence_steps=1, reduction=Reduction.SUM,
        unit="nats", labels=(),
        point="after the forward pass of every micro-batch, summed over the optimizer step",
        doc="Σ_t m_t·ℓ_t: negative log-likelihood summed over valid target tokens of this rank. "
            "L = Σ_r loss.sum / Σ_r loss.tokens; L_r = loss.sum / loss.tokens on one rank.",
        seed="001 §3 (global mean loss, local mean loss)",
        replicated_over=frozenset({Group.TENSOR}),
    ),
    MetricSpec(
        name="loss.tokens", priority=Priority.P0, cadence_steps=1, reduction=Reduction.SUM,
        unit="tokens", labels=(),
        point="with loss.sum: the count of valid targets (padding and ignored labels excluded)",
        doc="Σ_t m_t: valid target tokens on this rank; the denominator of L and L_r, and "
            "N_tok for throughput. A rank with zero valid tokens is skipped in L_max.",
        seed="001 §3, §5 (N_tok)",
        replicated_over=frozenset({Group.TENSOR}),
    ),
    MetricSpec(
        name="grad.norm_sq", priority=Priority.P0, cadence_steps=1, reduction=Reduction.SUM,
        unit="1", labels=(), point=_GRAD_POINT,
        doc="Σ_j g_j² over the gradient elements this rank holds. G2 = sqrt(Σ over shards); "
            "data-parallel ranks hold the same all-reduced gradient, so one replica counts.",
        seed="001 §4 (global gradient norm G2)",
        replicated_over=frozenset({Group.DATA}),
    ),
    MetricSpec(
        name="step_time_s", priority=Priority.P0, cadence_steps=1, reduction=Reduction.MAX,
        unit="s", labels=(),
        point="wall time of the whole step on this rank: data loading, forward, backward, "
              "optimizer and synchronisation",
        doc="τ_r. The step's wall time is τ = max_r τ_r; the straggler score uses the median.",
        seed="001 §5 (step time, straggler score)",
    ),
    MetricSpec(
        name="export.dropped_total", priority=Priority.P1, cadence_steps=1,
        reduction=Reduction.PER_RANK, unit="steps", labels=(),
        point="the rank's emitter, when a step's points are enqueued",
        doc="Cumulative count of steps whose measurements this rank's bounded export queue "
            "could not hold. Non-zero means data was lost on the rank, not in the pipeline.",
        seed="DESIGN 'Nothing silently lost'",
    ),
)

CATALOG: Mapping[str, MetricSpec] = MappingProxyType({s.name: s for s in _SPECS})


def spec(name: str) -> MetricSpec:
    """The catalog entry for ``name``; a clear KeyError for an unknown metric."""
    try:
        return CATALOG[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; the catalog has {sorted(CATALOG)}") from None
