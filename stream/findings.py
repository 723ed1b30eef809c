"""What a detector found, where to look next, and the detectors' configuration: the
vocabulary ``signals``, ``directions`` and stage 2 share (``signals`` re-exports it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum

from .detect import MIN_SPREAD

__all__ = ["Category", "DetectorConfig", "Finding", "RankSeries", "next_steps"]


class Category(IntEnum):
    """The escalation order of seeds 001 §1, then the layer-level views."""

    JOB = 0
    LOSS = 1
    GRAD = 2
    TIME = 3
    MEMORY = 4
    EXPERTS = 5
    LAYERS = 6


_WHAT_TO_OPEN = {
    Category.JOB: "job state: ranks_missing / late data in step_metrics and rank_metrics",
    Category.LOSS: "loss: loss_worst_rank and its rank, loss_by_source against each source's "
    "own history",
    Category.GRAD: "gradient norm and spikes: grad_norm, loss_z/grad_z, clip_rate, co-spikes",
    Category.TIME: "step time: step_time_s per rank, straggler_score and straggler_own_ratio, "
    "exposed collective wait",
    Category.MEMORY: "memory: peak_memory_bytes per rank and its growth",
    Category.EXPERTS: "expert balance: moe_maxvio, H_norm and per-expert load in expert_stats",
    Category.LAYERS: "layer views: tensor_view backward abs max walking inward from the output",
}


def next_steps(category: Category) -> list[str]:
    """What to open next, in escalation order, starting at the category that moved."""
    return [_WHAT_TO_OPEN[c] for c in Category if c >= category]


@dataclass(slots=True, kw_only=True)
class Finding:
    """One anomaly at one step; ``page`` marks the P0 conditions that become alerts."""

    signal: str
    kind: str  # spike | cospike | nonfinite | threshold | drift | straggler
    value: float
    baseline: float | None
    z: float | None
    category: Category
    page: bool
    culprit: str = ""  # "rank 3", "source code", "layer 2", ...
    ranks: list[int] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class DetectorConfig:
    """Thresholds are configuration; ``probewire calibrate`` derives z thresholds."""

    window: int = 100
    early_history: int = 10  # L, G2 and the loss culprits are scored from this many values...
    early_z_factor: float = 2.0  # ...against this x their threshold until the window is full
    loss_z: float = 6.0
    grad_z: float = 6.0
    signal_z: float = 8.0  # single-signal pages (worst rank, source, step time...)
    min_spread: float = MIN_SPREAD  # floor under every robust score's spread (log units)
    straggler_ratio: float = 5.0  # one rank's own-time ratio over its own baseline...
    straggler_steps: int = 3  # ...on every one of this many consecutive steps: a page
    # when the job's step time is at least this x its baseline on each of them: a gross
    # straggler costs the job time, here 1 + (straggler_ratio - 1) x derive.OWN_FLOOR (its
    # own time, at least 5 % of the step, grown 5x on the critical path); two ranks'
    # own-time ratio also explodes when the other rank's own time merely shrinks
    straggler_job_slowdown: float = 1.2
    straggler_held_ratio: float = 1.05  # or (3+ ranks): above this on nine steps in ten...
    straggler_held_steps: int = 40  # ...of this many consecutive steps
    straggler_held_quantile: float = 0.1
    # or (3+ ranks): its own-time ratio over its baseline at this quantile of the last
    # straggler_recent_steps steps (0.3: on seven steps in ten of 12) at least this
    straggler_recent_steps: int = 12
    straggler_recent_quantile: float = 0.3
    straggler_recent_ratio: float = 1.3
    # a one-sided CUSUM per rank on its own-time ratio against its own baseline (at least
    # parity) in scales s = max(min_scale, its own spread, its peers' joint spread of the
    # last steps): min(x / s, cap) - k a step, reset at parity, a page at h (``shifts``)
    straggler_cusum_k: float = 1.0
    straggler_cusum_cap: float = 3.0
    straggler_cusum_h: float = 12.0
    straggler_cusum_scale: float = 0.05
    # the same on each rank's own loss L_r over the other ranks' median (3+ ranks)
    loss_shift_k: float = 1.5
    loss_shift_cap: float = 4.0
    loss_shift_h: float = 12.0
    loss_shift_scale: float = 0.01
    loss_shift_delay: int = 20  # a rank's loss ratio joins its history this many steps late
    shift_history: int = 20  # values of a rank's history before its CUSUMs score
    clip_threshold: float = 1.0
    clip_window: int = 100
    memory_growth: float = 0.2  # page when peak memory exceeds its baseline by 20%
    maxvio_threshold: float = 2.0  # busiest expert carries 3x the mean load
    maxvio_steps: int = 3  # ... on this many consecutive steps after warm-up
    media_scale_min: float = 0.1  # γ below this: media the backbone can ignore
    residual_ratio_min: float = 2.0**-8  # R_b below bf16's relative precision: swallowed
    residual_ratio_max: float = 100.0  # R_b above this: the branch overwrites the stream
    # (healthy demo branches reach 16-26 in their first 100 steps)
    grad_audit_tolerance: float = 0.01  # |loop's norm - G2| / G2 above this: a page
    clip_rate_rise: float = 0.25  # clip rate (full window) above its baseline by this
    shard_imbalance_max: float = 1.5  # busiest EP shard / mean shard load (maxvio_steps)
    h_norm_drop: float = 0.1  # router entropy H_norm below its baseline by this
    pi_shift: float = 0.1  # a modality's token share this far from its baseline
    media_scale_max: float = 100.0  # gamma above this: media swamp the backbone (the full
    # demo preset, healthy, reaches 17 in its first 100 steps)
    vanish_ratio: float = 1e-3  # G2, or a group's G_max, below this x its baseline
    # (straggler_steps measured steps)
    headroom_min: float = 0.05  # 1 - peak / capacity of the worst rank below this
    # held-out BPB (the evaluator's ``bpb``, reference weights stream): a suite's value this
    # far (relative) above the median of its last heldout_window evaluations pages, from
    # heldout_min_history evaluations on
    heldout_bpb_rise: float = 0.02
    heldout_window: int = 5
    heldout_min_history: int = 3
    rearm_steps: int = 50


@dataclass(slots=True)
class RankSeries:
    """Per-rank values of one step the culprit rules score against each rank's history:
    the local mean loss L_r and the own-time ratio rho_r (``derive.own_time_ratios``); each
    source's loss over the ranks other than the worst one; and the per-part values the
    directional rules name a culprit by: each residual branch's token-mean R_b ("layer L
    attn|mlp", at a step that measures them) and each gradient parameter group's G_max."""

    loss: Mapping[int, float] = field(default_factory=dict)
    own_ratio: Mapping[int, float] = field(default_factory=dict)
    source_loss_without_worst: Mapping[str, float] = field(default_factory=dict)
    branch_ratio: Mapping[str, float] = field(default_factory=dict)
    group_grad_max: Mapping[str, float] = field(default_factory=dict)
