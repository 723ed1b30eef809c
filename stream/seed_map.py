"""Every item of the five seed documents with what probewire does with it: the seed map.

An item is a metric, a rule or a pitfall of one seed section (``SeedItem``), with a status:

* **full**: implemented as the seed defines it; ``where`` names the stored column or view
  and the module that holds the rule;
* **partial**: something is implemented (``where``) and ``missing`` says what is not (a
  series pooled where the seed has one per tensor, components stored but never formed, a
  default the loop does not set, ...);
* **out of scope**: not implemented, and ``missing`` says why.

Seed 000 is a summary of 001 (the same sections, its formulas written out): an item of 001
that 000 repeats cites the 000 section in ``also``, and 000's own additions are items of
their own. 003 and 004 are general guides; their items carry their own status, because
they often ask for something else (a fixed threshold, a histogram, a tool).

Stored columns are named through helpers that check them at import, so a typo fails:
``_f`` (a registry series, ``stream.series``), ``_c`` (a column of a table or view of
``sinks.schema``), ``_t`` (a table or view) and ``_rm`` (catalog metrics stored per rank in
``rank_metrics``). A registry row whose ``seed`` names an item ("002 moe/maxvio.mean
(.max)") and that the list does not mention yet is added to that item's ``where`` (or
becomes an item of its own, partial until someone reviews it), so a new series needs no
edit here.

``seed_map_doc()`` is docs/seed-map.md and ``readme_summary()`` the README's region between
its metric-table markers (a unit test holds both equal to the files); ``python -m
probewire.stream.seed_map`` prints the coverage line, ``--doc`` / ``--readme`` the two texts,
and ``--write [ROOT]`` rewrites both files of the repository at ROOT (default: here).
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from probewire.instrument.catalog import (
    CATALOG,
    Comm,
    Device,
    Host,
    Loss,
    Memory,
    Modality,
    Module,
    Moe,
    Net,
    Residual,
)
from probewire.sinks.schema import TABLES, VIEWS, View

from .series import FORMED, STEP_SERIES, Series

__all__ = [
    "DOCS",
    "SECTIONS",
    "SEED_ITEMS",
    "SeedItem",
    "Status",
    "counts",
    "coverage",
    "metric_table",
    "readme_summary",
    "seed_map_doc",
    "stored_columns",
    "write",
]


class Status(StrEnum):
    FULL = "full"
    PARTIAL = "partial"
    OUT = "out of scope"


DOCS = {
    "000": "summary of 001 with every formula (Chinese)",
    "001": "Reading a Pretraining Run, the English reference",
    "002": "output-layer, MoE-bias, MTP and per-module metrics (Chinese)",
    "003": "training monitoring and debugging, a general guide (Chinese)",
    "004": "key pretraining monitoring metrics, a general guide (Chinese)",
}

SECTIONS: dict[str, tuple[str, ...]] = {
    "000": (
        "quick read",
        "contributions",
        "background",
        "loss",
        "gradients",
        "system",
        "tensors",
        "experts",
        "residual",
        "modality",
        "environment",
        "evaluation",
        "conclusion",
        "mistakes",
        "probe cost",
    ),
    "001": tuple(f"§{n}" for n in range(13)),
    "002": ("§1", "§2", "§3", "§4"),
    "003": ("§1", "§2", "§3", "§4", "§5", "§6", "§7"),
    "004": ("§1", "§2", "§3", "§4", "§5"),
}
"""Each document's sections, as items cite them (000 has no numbers: its headings)."""


@dataclass(frozen=True, slots=True)
class SeedItem:
    doc: str  # "001"
    section: str  # "§3", or a heading of 000
    item: str
    status: Status
    where: str = ""  # markdown: stored columns, views, modules
    missing: str = ""  # partial: what is missing; out of scope: why
    also: tuple[str, ...] = ()  # the same item in other documents: "000 loss"

    @property
    def seed(self) -> str:
        return f"{self.doc} {self.section}"

    def cites(self, doc: str) -> bool:
        return self.doc == doc or any(a.split(" ", 1)[0] == doc for a in self.also)


# ------------------------------------------------------------------ checked names
def _view_columns(view: View) -> set[str]:
    """The output columns of a view: its top-level SELECT list (aliases, else names)."""
    text = view.select.strip()[len("SELECT") :]
    depth, start, items = 0, 0, []
    for at, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        end = depth == 0 and text.startswith("\nFROM", at)
        if end or (depth == 0 and ch == ","):
            items.append(text[start:at])
            start = at + 1
        if end:
            break
    out = set()
    for entry in (i.strip() for i in items):
        alias = re.search(r"\bAS\s+(\w+)\s*$", entry)
        out.add(alias.group(1) if alias else entry.rsplit(".", 1)[-1])
    return out


def stored_columns() -> dict[str, set[str]]:
    """Every table and view of the schema with its columns."""
    found = {t.name: {c.name for c in t.columns} for t in TABLES}
    found.update({v.name: _view_columns(v) for v in VIEWS})
    return found


_STORED = stored_columns()
_REGISTRY: tuple[tuple[str, Series], ...] = (
    *(("step_metrics", s) for s in STEP_SERIES),
    *((f.table, f.series) for f in FORMED if f.table != "step_metrics"),
)


def _code(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _f(*columns: str) -> str:
    """``table.column`` of registry series (checked against the registry at import)."""
    known = {f"{table}.{s.name}" for table, s in _REGISTRY}
    unknown = [c for c in columns if c not in known]
    if unknown:
        raise ValueError(f"not in the registry (stream.series): {unknown}")
    return _code(columns)


def _c(*columns: str) -> str:
    """``table.column`` of a table or view of ``sinks.schema`` (checked at import)."""
    unknown = [c for c in columns if c.split(".")[-1] not in _STORED.get(c.split(".")[0], ())]
    if unknown:
        raise ValueError(f"not a column of sinks.schema TABLES/VIEWS: {unknown}")
    return _code(columns)


def _t(*names: str) -> str:
    """Tables or views of ``sinks.schema`` (checked at import)."""
    unknown = [n for n in names if n not in _STORED]
    if unknown:
        raise ValueError(f"not a table or view of sinks.schema: {unknown}")
    return _code(names)


def _rm(*metrics: str) -> str:
    """Catalog metrics (``*`` globs, ``{labels}`` allowed) kept per rank in ``rank_metrics``."""
    unknown = [m for m in metrics if not fnmatch.filter(CATALOG, m.split("{")[0])]
    if unknown:
        raise ValueError(f"not in the catalog (instrument.catalog): {unknown}")
    return f"{_t('rank_metrics')} ({_code(metrics)})"


def _s(seed: str) -> tuple[str, str]:
    doc, _, section = seed.partition(" ")
    if section not in SECTIONS[doc]:
        raise ValueError(f"seed {doc} has no section {section!r}")
    return doc, section


def _item(
    seed: str, item: str, status: Status, where: str, missing: str, also: tuple[str, ...]
) -> SeedItem:
    for other in also:
        _s(other)  # a citation of a section the document has
    return SeedItem(*_s(seed), item, status, where, missing, also)


def _full(seed: str, item: str, where: str, also: tuple[str, ...] = ()) -> SeedItem:
    return _item(seed, item, Status.FULL, where, "", also)


def _part(seed: str, item: str, where: str, missing: str, also: tuple[str, ...] = ()) -> SeedItem:
    return _item(seed, item, Status.PARTIAL, where, missing, also)


def _out(seed: str, item: str, why: str, where: str = "", also: tuple[str, ...] = ()) -> SeedItem:
    return _item(seed, item, Status.OUT, where, why, also)


def _p(path: str, *names: str) -> str:
    """A module (path from the repository root; a test checks it exists) and names in it."""
    return f"`{path}`" + (f" ({_code(names)})" if names else "")


# ------------------------------------------------------------------ the items
_EVAL = "`evaluations` (metric {})"
_RETAINED = "stored per rank for retained steps only"
_STATIC = (
    "fixed thresholds are not rules here: each series is scored against its own rolling "
    "baseline, with thresholds calibrated on stable runs (001 §4)"
)

_001: tuple[SeedItem, ...] = (
    # §0 priorities
    _full(
        "001 §0",
        "priority levels P0 alert, P1 diagnose, P2 forensics",
        _p("instrument/catalog.py", "MetricSpec.priority", "Priority"),
        ("000 contributions",),
    ),
    _part(
        "001 §0",
        "a P0 metric is wired to a pager",
        _p("stream/signals.py", "SignalDetectors") + ", " + _p("stream/pages.py", "PageGate"),
        "clip rate, compute rate Φ, shard imbalance and the evaluation scores are P0 but "
        "no rule pages on them",
    ),
    _full(
        "001 §0",
        "default cadence: P0 every step, P1 every 100 steps, P2 on demand",
        _p("instrument/config.py", "DEFAULT_CADENCE", "ProbeConfig.cadence"),
        ("000 background",),
    ),
    # §1 first screen
    _full(
        "001 §1",
        "one first screen of nine P0 signals",
        _t("first_screen", "loss_by_source")
        + ", "
        + _c("first_screen.heldout_bpb")
        + "; the report's nine panels "
        + _p("stream/series.py", "CHARTS")
        + ", "
        + _p("deploy/grafana/probewire-first-screen.json"),
        ("000 background",),
    ),
    _part(
        "001 §1",
        "memory headroom before the first out-of-memory failure",
        _f(
            "step_metrics.memory_headroom",
            "step_metrics.memory_capacity_bytes",
            "step_metrics.peak_memory_bytes",
        ),
        "not on the first screen and no rule pages low headroom yet (issue 38); on CPU the "
        "capacity is the cgroup or host limit the node's ranks share",
        ("000 background",),
    ),
    _full(
        "001 §1",
        "escalation order: job state → loss → G2 and spikes → step time → memory → experts",
        _p("stream/signals.py", "Category", "next_steps")
        + ", "
        + _p("deploy/explain/model.py", "STAGES")
        + "; job state: "
        + _c("runs.status")
        + ", "
        + _f("step_metrics.ranks_missing", "step_metrics.complete_reason"),
        ("000 background", "000 contributions"),
    ),
    # §2 metric index
    _full(
        "001 §2",
        "cadence rule: alerts every step, scans every 100 steps, evaluation every 0.5–2 %",
        _p("instrument/config.py", "DEFAULT_CADENCE")
        + ", "
        + _p("evaluators/cadence.py", "every_fraction"),
        ("000 background",),
    ),
    _full(
        "001 §2",
        "an anomaly triggers denser probes or a replay",
        _p("stream/stage2.py", "densify", "dump")
        + ", "
        + _p("instrument/control.py", "ControlListener"),
        ("000 background",),
    ),
    _full(
        "001 §2",
        "compare runs by cumulative tokens or FLOPs, never by step",
        _f("step_metrics.tokens", "step_metrics.flops")
        + "; the report's x axis "
        + _p("deploy/report/interactive.py", "AXES"),
        ("000 background",),
    ),
    # §3 loss
    _full("001 §3", "global mean loss L", _f("step_metrics.loss"), ("000 loss",)),
    _part(
        "001 §3",
        "local mean loss L_r",
        _rm(Loss.SUM, Loss.TOKENS),
        f"components only, {_RETAINED}; the detectors read every rank's L_r but no L_r "
        "series is stored",
        ("000 loss",),
    ),
    _full(
        "001 §3",
        "a rank with no valid target is skipped, never a zero",
        _p("instrument/probes/loss.py") + ", " + _p("stream/inputs.py", "StepInputs.worst"),
        ("000 loss",),
    ),
    _full(
        "001 §3",
        "worst-rank loss L_max",
        _f("step_metrics.loss_worst_rank", "step_metrics.loss_worst_rank_id"),
        ("000 loss",),
    ),
    _full(
        "001 §3",
        "loss by source and modality L^(μ)",
        _c("source_metrics.loss", "loss_by_source.loss"),
        ("000 loss",),
    ),
    _full(
        "001 §3",
        "token share π^(μ) reported with the group loss",
        _c("source_metrics.token_share", "loss_by_source.token_share"),
        ("000 loss",),
    ),
    _full(
        "001 §3",
        "each group against its own history",
        _p("stream/signals.py", "_sources"),
        ("000 loss",),
    ),
    _full(
        "001 §3",
        "reduce loss sums and token counts separately, then divide",
        _p("stream/derive.py", "global_mean_loss") + ", catalog reduction `sum`",
        ("000 loss",),
    ),
    # §4 gradients and spikes
    _full("001 §4", "global gradient norm G2", _f("step_metrics.grad_norm"), ("000 gradients",)),
    _full(
        "001 §4",
        "gradients measured after accumulation and unscaling, before clipping",
        _p("instrument/step.py", "StepContext.gradients") + ", `MetricSpec.point`",
        ("000 gradients",),
    ),
    _full(
        "001 §4",
        "clip rate over the last W steps against the clip threshold c",
        _f("step_metrics.clip_rate", "step_metrics.clipped")
        + ", "
        + _p("stream/detect.py", "ClipRateWindow")
        + " (c: the loop's max_norm, sent as `grad.clip_threshold`; ranks that send different "
        "c are a dead letter with the reason, " + _p("stream/view.py", "clip_disagreement") + ")",
        ("000 gradients",),
    ),
    _full(
        "001 §4",
        "mean absolute gradient G_mean",
        _f("step_metrics.grad_abs_mean"),
        ("000 gradients",),
    ),
    _full(
        "001 §4",
        "maximum absolute gradient G_max",
        _f("step_metrics.grad_abs_max"),
        ("000 gradients",),
    ),
    _full(
        "001 §4",
        "gradient zero fraction Z_g",
        _f("step_metrics.grad_zero_frac"),
        ("000 gradients",),
    ),
    _full(
        "001 §4",
        "G_mean, G_max, Z_g of embeddings and experts apart",
        _f(
            "grad_group_stats.grad_abs_mean",
            "grad_group_stats.grad_abs_max",
            "grad_group_stats.grad_zero_frac",
        ),
        ("000 gradients",),
    ),
    _full(
        "001 §4",
        "record each gradient metric's timing (scaled, accumulated, clipped)",
        _p("instrument/catalog.py", "MetricSpec.point"),
        ("000 gradients",),
    ),
    _part(
        "001 §4",
        "rolling median q_t and deviation D_t",
        _p("stream/detect.py", "RobustSpikeDetector") + ", " + _c("anomalies.baseline"),
        "kept in the detector state (`stream_state`); the median reaches `anomalies.baseline` "
        "of a finding only, and neither is stored per step",
        ("000 gradients",),
    ),
    _part(
        "001 §4",
        "robust spike score z_t",
        _f("step_metrics.loss_z", "step_metrics.grad_z"),
        "divides by max(D_t, 10⁻³) instead of D_t + ε (a deliberate spread floor: a constant "
        "window would score a 1 % move ~10⁶), and only upward moves are spikes",
        ("000 gradients", "000 quick read"),
    ),
    _full(
        "001 §4",
        "separate detectors for L and G2",
        _f("step_metrics.loss_spike", "step_metrics.grad_spike")
        + ", "
        + _p("stream/signals.py", "SignalDetectors"),
        ("000 gradients",),
    ),
    _full(
        "001 §4",
        "co-spike C_t with cumulative count and magnitude; the one to page on",
        _f("step_metrics.cospike", "step_metrics.cospike_count", "step_metrics.cospike_magnitude")
        + ", "
        + _p("stream/detect.py", "CoSpikeTracker"),
        ("000 gradients", "000 quick read"),
    ),
    _part(
        "001 §4",
        "skip and replay counters (replays that did not reproduce)",
        _f(
            "step_metrics.skipped",
            "step_metrics.replayed",
            "step_metrics.replay_mismatch",
            "step_metrics.skipped_step",
            "step_metrics.replayed_step",
            "step_metrics.replay_mismatch_step",
        ),
        "AMP GradScaler skips are counted only when the scaler is passed to `s.gradients(scaler=)`",
        ("000 gradients",),
    ),
    _full(
        "001 §4",
        "calibrate window and z threshold on stable runs, never on one failure",
        _p("stream/calibration.py", "calibrate_run")
        + ", `probewire calibrate` (refuses a run shorter than three windows)",
        ("000 gradients",),
    ),
    # §5 system health
    _full(
        "001 §5",
        "step time τ = max over ranks, the whole step",
        _f("step_metrics.step_time_s"),
        ("000 system",),
    ),
    _full(
        "001 §5",
        "token throughput TPS",
        _f("step_metrics.tokens_per_s", "step_metrics.step_tokens"),
        ("000 system",),
    ),
    _part(
        "001 §5",
        "compute rate Φ with a fixed FLOP estimator",
        _f("step_metrics.compute_rate") + ", `ProbeConfig.flops_per_token`",
        "D is taken as the number of ranks (one device per rank assumed): a rank driving "
        "several devices gets a Φ too large",
        ("000 system",),
    ),
    _full(
        "001 §5",
        "straggler score S",
        _f(
            "step_metrics.straggler_score",
            "step_metrics.straggler_rank",
            "step_metrics.straggler_own_ratio",
        ),
        ("000 system",),
    ),
    _full(
        "001 §5",
        "peak memory, max over ranks, reset at a documented boundary",
        _f("step_metrics.peak_memory_bytes", "step_metrics.peak_memory_rank"),
        ("000 system",),
    ),
    _part(
        "001 §5",
        "allocated and reserved memory",
        _rm(Memory.ALLOCATED, Memory.RESERVED),
        f"components only, {_RETAINED}; the reserved − allocated gap is not formed",
        ("000 system",),
    ),
    _part(
        "001 §5",
        "exposed collective wait W_comm",
        _f("step_metrics.comm_wait_frac"),
        "the largest exposed wait a rank measured, not the critical-path wait; DDP's "
        "bucketed all-reduce counts only when the loop reports it",
        ("000 system",),
    ),
    _part(
        "001 §5",
        "collective call count and payload beside W_comm",
        _rm(Comm.CALLS, Comm.BYTES),
        f"{_RETAINED}; not formed beside `step_metrics.comm_wait_frac`",
        ("000 system",),
    ),
    _part(
        "001 §5",
        "device and host telemetry",
        _rm("device.*", "host.*", "net.*"),
        f"measured every step but {_RETAINED}; no step-level series",
        ("000 system",),
    ),
    _full(
        "001 §5",
        "device events around the real wait, read at an existing sync point",
        _p("instrument/probes/comm.py"),
        ("000 system",),
    ),
    _full(
        "001 §5",
        "network counters read once per node",
        _rm(Net.RX, Net.TX)
        + " from each node's local rank 0, summed over nodes every step in "
        + _f("step_metrics.net_rx_bytes", "step_metrics.net_tx_bytes"),
        ("000 system",),
    ),
    # §6 tensor probes
    _full(
        "001 §6",
        "absolute maximum; at the model output a P0 of its own",
        _c("tensor_view.abs_max", "tensor_view.nonfinite")
        + ", "
        + _f("step_metrics.output_absmax"),
        ("000 tensors",),
    ),
    _part(
        "001 §6",
        "RMS (stored as squared sum and count) and absolute mean",
        _c("tensor_view.rms", "tensor_view.abs_mean", "tensor_stats.sum_sq", "tensor_stats.n"),
        "divide by the finite elements, not N: a NaN/Inf element is counted in "
        "`tensor_view.nonfinite` instead of making the statistic NaN",
        ("000 tensors",),
    ),
    _full("001 §6", "zero fraction Z_x", _c("tensor_view.zero_frac"), ("000 tensors",)),
    _full(
        "001 §6",
        "excess kurtosis κ (P2)",
        _c("tensor_view.excess_kurtosis"),
        ("000 tensors",),
    ),
    _part(
        "001 §6",
        "observation points: embeddings … logits, gradients, updates",
        _p("instrument/config.py", "DEFAULT_MODULE_NAMES") + ", " + _c("tensor_stats.kind"),
        "expert inputs and outputs are not among the default points (a "
        "`ProbeConfig.module_names` pattern adds them)",
        ("000 tensors",),
    ),
    _full(
        "001 §6",
        "forward activations and backward gradients named apart",
        "`tensor_stats.kind` `fwd` / `bwd`",
        ("000 tensors",),
    ),
    _full(
        "001 §6",
        "reading an explosion: the backward maximum walked inward from the output",
        _p("deploy/explain/score.py", "_layers") + ", " + _p("stream/localize.py"),
        ("000 tensors",),
    ),
    _full(
        "001 §6",
        "sums and counts before means, maxima by max, never an average of maxima",
        _p("stream/reduce.py", "reduce_step") + ", `MetricSpec.reduction`",
        ("000 tensors",),
    ),
    _full(
        "001 §6",
        "relative update size ρ",
        _f(
            "step_metrics.update_ratio_min",
            "step_metrics.update_ratio_min_tensor",
            "step_metrics.update_ratio_max",
            "step_metrics.update_ratio_max_tensor",
            "step_metrics.update_ratio",
        )
        + " (pooled), "
        + _c("tensor_update_ratio.update_ratio")
        + " per tensor of retained scan steps",
        ("000 tensors", "000 quick read"),
    ),
    _part(
        "001 §6",
        "optimizer chain: raw, normalized, preconditioned, applied (P2)",
        "`tensor_stats.kind` `opt_grad`, `opt_normalized`, `opt_direction`, `update`, "
        + _p("instrument/probes/tensors.py", "adamw_chain"),
        "only for optimizers with AdamW's moments (`exp_avg`, `exp_avg_sq`)",
        ("000 tensors",),
    ),
    _full(
        "001 §6",
        "optimizer tensors say before or after each optimizer stage",
        _p("instrument/catalog.py", "MetricSpec.point"),
        ("000 tensors",),
    ),
    # §7 expert balance
    _full(
        "001 §7",
        "imbalance ratio I and MaxVio",
        _f("step_metrics.moe_maxvio", "step_metrics.moe_maxvio_mean")
        + ", "
        + _c("expert_balance.imbalance", "expert_balance.max_violation"),
        ("000 experts",),
    ),
    _part(
        "001 §7",
        "shard imbalance over expert-parallel shards",
        _f("step_metrics.moe_shard_imbalance") + ", " + _c("expert_balance.shard_imbalance"),
        "the placement comes from each MoE layer's `local_expert_indices`; a model without "
        "it (fused grouped experts) falls back to contiguous placement over the `ep` "
        "coordinate",
        ("000 experts",),
    ),
    _full(
        "001 §7",
        "routing entropy H and H_norm",
        _f("step_metrics.moe_h_norm") + ", " + _c("expert_balance.h_norm"),
        ("000 experts",),
    ),
    _full(
        "001 §7",
        "per-expert load (P2)",
        _c("expert_stats.tokens", "expert_balance.busiest_expert"),
        ("000 experts",),
    ),
    _part(
        "001 §7",
        "router bias terms, top-k margin distributions (P2)",
        _rm(Moe.ROUTER_BIAS, "moe.topk_margin_*"),
        f"components only, on demand, {_RETAINED}; not formed",
        ("000 experts",),
    ),
    _full(
        "001 §7",
        "exclude padding; a layer with no valid token has no ratio",
        _p("stream/derive.py", "expert_balance") + ", `expert_balance` HAVING layer_tokens > 0",
        ("000 experts",),
    ),
    # §8 residual paths
    _part(
        "001 §8",
        "relative branch scale R_b with N_s and N_b, across depth",
        _f(
            "step_metrics.residual_ratio_min",
            "step_metrics.residual_ratio_branch",
            "step_metrics.residual_stream_norm",
            "step_metrics.residual_branch_norm",
        ),
        "per layer on every step that measures it in "
        + _c("residual_stats.ratio")
        + "; no report chart draws the depth profile yet",
        ("000 residual", "000 quick read"),
    ),
    _part(
        "001 §8",
        "block importance B and angular distance A",
        _rm("residual.importance_*", "residual.angle_*"),
        f"components only, {_RETAINED}; not formed",
        ("000 residual",),
    ),
    _part(
        "001 §8",
        "bfloat16 no-op fraction F_noop",
        _rm("residual.noop_*"),
        f"components only, {_RETAINED}; not formed",
        ("000 residual",),
    ),
    _part(
        "001 §8",
        "gate saturation fraction at several thresholds θ",
        _rm(Residual.GATE_CLOSED, Residual.GATE_CHANNELS),
        f"components only, {_RETAINED}; not formed",
        ("000 residual",),
    ),
    _part(
        "001 §8",
        "per valid token, then the mean and upper quantiles",
        _rm("residual.*_sum", "residual.*_p90", "residual.*_p99", "residual.*_max"),
        "a quantile over ranks is the maximum of the ranks' own quantiles: an upper bound, "
        "exact with one rank",
        ("000 residual",),
    ),
    # §9 modality paths
    _part(
        "001 §9",
        "modality token share π^(μ) (P0, every 1–10 steps)",
        _f("step_metrics.modality_token_share")
        + " (first screen, from `modality.tokens`), "
        + _c("source_metrics.token_share")
        + " for modalities labelled on the loss",
        "no rule pages a shift of π (issue 38)",
        ("000 modality",),
    ),
    _full(
        "001 §9",
        "media scale ratio γ",
        _f("step_metrics.media_scale"),
        ("000 modality", "000 quick read"),
    ),
    _full(
        "001 §9",
        "encoder gradient share S_enc",
        _f("step_metrics.encoder_grad_share"),
        ("000 modality", "000 quick read"),
    ),
    _full(
        "001 §9",
        "token-weighted per-modality statistics; a rank without media is not a zero",
        _p("instrument/probes/modality.py") + ", " + _p("stream/derive.py", "media_scale"),
        ("000 modality",),
    ),
    # §10 evaluation
    _full(
        "001 §10",
        "held-out NLL and perplexity",
        _EVAL.format("`nll`, `ppl`"),
        ("000 evaluation",),
    ),
    _full(
        "001 §10",
        "bits per byte, on the first screen",
        _EVAL.format("`bpb`") + ", " + _c("first_screen.heldout_bpb"),
        ("000 evaluation", "000 quick read"),
    ),
    _full(
        "001 §10",
        "choice accuracy by length-normalized option NLL, frozen prompts",
        _EVAL.format("`accuracy`") + ", " + _c("evaluations.prompt_version"),
        ("000 evaluation",),
    ),
    _full(
        "001 §10",
        "greedy generation (temperature 0, post-processed)",
        _EVAL.format("the judge's name, `exact_match`"),
        ("000 evaluation",),
    ),
    _full(
        "001 §10",
        "media gain Δ_media",
        _EVAL.format("`{m}_media_gain`, `{m}_with_media`, `{m}_without_media`"),
        ("000 evaluation", "000 quick read"),
    ),
    _full("001 §10", "pass@k", _EVAL.format("`pass@k`"), ("000 evaluation",)),
    _full("001 §10", "intersection over union", _EVAL.format("`iou`"), ("000 evaluation",)),
    _full(
        "001 §10",
        "averaged-weight evaluation, one reference stream",
        _c("evaluations.weights_stream", "evaluations.reference"),
        ("000 evaluation",),
    ),
    _full(
        "001 §10",
        "version data set, tokenizer, prompt, decoding, post-processing, judge",
        _c(
            "evaluations.dataset_version",
            "evaluations.tokenizer_version",
            "evaluations.judge_version",
        ),
    ),
    _full(
        "001 §10",
        "extrapolation reports a bound outside the fitted range",
        _p("evaluators/scaling.py", "scaling_report"),
    ),
    # §11 common mistakes
    _full(
        "001 §11",
        "everything is P0",
        _p("stream/pages.py", "PageGate") + ": few rules page, one page per episode",
        ("000 mistakes", "000 quick read"),
    ),
    _full(
        "001 §11",
        "wrong reduction group",
        _p("stream/reduce.py", "_replica_class") + ", `MetricSpec.replicated_over`",
        ("000 mistakes",),
    ),
    _full(
        "001 §11",
        "unclear maximum (elements, tokens, examples or ranks)",
        "names say it: `loss_worst_rank` over ranks, `grad.abs_max` over elements, "
        "`residual.ratio_max` over tokens",
        ("000 mistakes",),
    ),
    _full(
        "001 §11",
        "ambiguous timing",
        _p("instrument/catalog.py", "MetricSpec.point") + ", `tensor_stats.kind`",
        ("000 mistakes",),
    ),
    _full(
        "001 §11",
        "duplicate recomputation under activation checkpointing",
        _p("instrument/probes/tensors.py", "recomputing"),
        ("000 mistakes",),
    ),
    _full(
        "001 §11",
        "empty shards recorded as zeros",
        "nothing measured is sent; a formed series without components is NULL",
        ("000 mistakes",),
    ),
    _full(
        "001 §11",
        "padding counted as tokens",
        "valid-target masks in " + _p("instrument/probes/loss.py") + "; `tokens.positions` apart",
        ("000 mistakes",),
    ),
    _full(
        "001 §11",
        "over-smoothing",
        _t("step_metrics")
        + " unsmoothed; optional smoothing keeps the raw line "
        + _p("deploy/report/interactive.py"),
        ("000 mistakes", "000 quick read"),
    ),
    _full(
        "001 §11",
        "high-cardinality labels",
        _p("stream/validate.py") + " (`max_label_values`), " + _t("tensor_names"),
        ("000 mistakes", "000 quick read"),
    ),
    _part(
        "001 §11",
        "sensitive artifacts opt-in, access-controlled, short-lived",
        "`sensitive_artifacts` (opt-in, TTL 1–90 days) "
        + _p("sinks/schema.py", "sensitive_artifacts"),
        "access control is the ClickHouse operator's grants; no probe writes raw samples",
        ("000 mistakes",),
    ),
    # §12 keeping probes cheap
    _full(
        "001 §12",
        "register observation points once",
        _p("instrument/discover.py") + ", " + _p("instrument/registry.py"),
        ("000 probe cost",),
    ),
    _full(
        "001 §12",
        "gate early: skip the scan on unsampled steps",
        "`ProbeConfig.persistent_hooks` = False " + _p("instrument/probes/tensors.py"),
        ("000 probe cost",),
    ),
    _full(
        "001 §12",
        "scan each tensor once",
        _p("instrument/scan.py") + ", " + _p("instrument/batchscan.py"),
        ("000 probe cost",),
    ),
    _out(
        "001 §12",
        "reduce in batches, one collective per reduction type",
        "the ranks issue no collective for metrics at all: each sends its components and "
        "stage 1 of the stream reduces them (DESIGN: reduction in the stream)",
        _p("stream/reduce.py", "reduce_step"),
        ("000 probe cost",),
    ),
    _full(
        "001 §12",
        "move only summaries off the device",
        _p("instrument/collect.py"),
        ("000 probe cost",),
    ),
    _full(
        "001 §12",
        "write asynchronously, never on the training path",
        _p("instrument/export.py", "StepEmitter") + ", `export.dropped_total`",
        ("000 probe cost",),
    ),
    _full(
        "001 §12",
        "retain every K-th step, anomalies ± 50–100 steps, the warm-up",
        _p("stream/retention.py", "RetentionPolicy") + ", `*_recent` tables",
        ("000 probe cost",),
    ),
    _full(
        "001 §12",
        "retain the final steps",
        _p("stream/retention.py", "RetentionPolicy.finish")
        + ", "
        + _p("stream/stage2.py", "RunPipeline.on_event", "RunPipeline.at_shutdown")
        + ": on the run's `finished` or `crashed` event once its last step is in, at the "
        "latest when the worker stops; after `run_idle_s` of silence for a run that never "
        "says",
        ("000 probe cost",),
    ),
    _full(
        "001 §12",
        "K = 1 for small runs, 100–200 for long ones; detectors every step",
        "`ProbeConfig.cadence`, `stream.stage2.retention_every_k`",
        ("000 probe cost",),
    ),
    _full(
        "001 §12",
        "a short in-memory ring buffer for the context before a trigger",
        _p("instrument/export.py") + " (`ProbeConfig.ring_every`, off by default)",
        ("000 probe cost", "000 quick read"),
    ),
    _full(
        "001 §12",
        "replay the affected batch under denser probes",
        _p("instrument/replay.py", "judge") + ", `Monitor.replay`",
        ("000 probe cost", "000 quick read"),
    ),
)

_000: tuple[SeedItem, ...] = (
    _full(
        "000 quick read",
        "the problem: overload of metrics versus the cost of probing",
        "the catalog's priorities and tiers, " + _p("instrument/catalog.py"),
    ),
    _full(
        "000 contributions",
        "an exact aggregation formula and measurement point for every metric",
        _p("instrument/catalog.py", "MetricSpec.reduction", "MetricSpec.point")
        + ", docs/metrics.md",
    ),
    _part(
        "000 modality",
        "S_enc read against the encoder's share of the parameters",
        _rm(Modality.ENCODER_PARAMS, Modality.ALL_PARAMS),
        f"components only, {_RETAINED}; the parameter share is not formed",
    ),
    _part(
        "000 modality",
        "S_enc split by layer: each layer's gradient contribution",
        _c("tensor_stats.sum_sq", "tensor_names.layer") + " (kind `grad`, scan steps)",
        "per tensor only; the per-layer share of ‖g‖² is not formed",
    ),
    _part(
        "000 environment",
        "GPU clusters, NCCL, bfloat16, MoE and multimodal runs",
        _p("instrument/probes/comm.py") + ", " + _p("instrument/probes/system.py"),
        "checked on CPU with gloo only: the CUDA paths (events, NVML) have not run in the "
        "tests, and `benchmarks/device.sh` has not run on a GPU (docs/performance.md)",
    ),
    _full(
        "000 conclusion",
        "measure a probe's overhead on the target layout before raising its cadence",
        _p("benchmarks/overhead.py") + ", " + _p("benchmarks/device.sh") + ", docs/performance.md",
    ),
)

_MODULE_ROWS = (
    ("grad/word_embeddings_abs.max", "module.grad_abs_max{module=embedding}"),
    ("grad/output_layer_abs.max", "module.grad_abs_max{module=output}"),
    ("grad/Wq_abs.max (Wk, Wv)", "module.grad_abs_max{module=q,k,v}"),
    ("grad/Wo_abs.max", "module.grad_abs_max{module=o}"),
    ("grad/mla_Q_up_abs.max (Q_down, KV_up, ...)", "module.grad_abs_max{module=q_up,...}"),
    ("grad/W_gate_rms (W_up, W_down)", Module.GRAD_SUM_SQ),
    ("grad/{name}_rms (layer norms)", "module.grad_sum_sq{module=norm_*}"),
    ("act/attn_out_before_proj_rms.avg", "module.act_sum_sq{module=attn_core}"),
    ("act/gate_scores_rms.avg", "module.act_sum_sq{module=gate_score}"),
)

_002: tuple[SeedItem, ...] = (
    _full(
        "002 §1",
        "squares and RMS in FP32 or wider, padding excluded",
        _p("instrument/scan.py")
        + " (float32 chunks or wider, float64 partials), valid-position masks",
    ),
    _full(
        "002 §1",
        "means weighted by valid elements, maxima by a MAX reduction",
        _p("stream/reduce.py", "reduce_step"),
    ),
    _full(
        "002 §1",
        "MoE counts: one optimizer step, summed over the EP group",
        _p("instrument/catalog.py", Moe.EXPERT_TOKENS),
    ),
    _full(
        "002 §1",
        "002's P0/P1/P2 are an investigation order; names follow the implementation",
        "the catalog's own priorities; this map names each 002 item's column",
    ),
    _full("002 §2", "act/output_layer_logits_rms.avg", _f("step_metrics.logits_rms")),
    _full(
        "002 §2",
        "moe/dead_expert_ratio",
        _f("step_metrics.dead_expert_ratio") + ", " + _c("expert_balance.dead_ratio"),
    ),
    _full(
        "002 §2",
        "bos_value_grad_...",
        _f("step_metrics.bos_value_grad_rms", "step_metrics.bos_value_grad_ratio"),
    ),
    _full("002 §2", "act/output_layer_logits_abs.max", _f("step_metrics.output_absmax")),
    _full("002 §2", "act/output_layer_logits_top2_diff.avg", _f("step_metrics.top2_gap_mean")),
    _full("002 §2", "act/output_layer_logits_top2_equal_ratio", _f("step_metrics.top2_tie_frac")),
    _full(
        "002 §2",
        "act/hidden_states_abs.max",
        _c("tensor_view.abs_max") + " (kind `fwd`, block outputs)",
    ),
    _part(
        "002 §2",
        "act/hidden_states_rms.avg",
        _c("tensor_view.rms") + " (kind `fwd`, block outputs)",
        "per block on scan steps; the mean over the layers is not a stored series",
    ),
    _full(
        "002 §2",
        "act/mtp_{k}_lm_head_top1_agreement",
        _f("step_metrics.mtp_agreement_by_depth", "step_metrics.mtp_agreement"),
    ),
    _full(
        "002 §2",
        "moe/maxvio.mean (.max)",
        _f("step_metrics.moe_maxvio_mean", "step_metrics.moe_maxvio")
        + ", "
        + _c("expert_balance.max_violation"),
    ),
    _full("002 §2", "moe/ep_bias_abs_sum", _f("step_metrics.ep_bias_abs_sum")),
    *(
        _part(
            "002 §2",
            name,
            _rm(component),
            f"on demand (off by default), components only, {_RETAINED}; not formed",
        )
        for name, component in _MODULE_ROWS
    ),
    _full(
        "002 §3",
        "MTP agreement on aligned target positions only",
        _p("instrument/probes/mtp.py"),
    ),
    _part(
        "002 §3",
        "MTP agreement read beside the true-label accuracy of each head",
        _f("step_metrics.mtp_agreement"),
        "the heads' accuracy against the labels is not measured, so there is nothing to "
        "read the agreement beside",
    ),
    _full(
        "002 §3",
        "the gate-score metric only for gated-attention variants",
        _p("instrument/discover.py") + ": `gate_score` exists only where a gate is found",
    ),
    _part(
        "002 §4",
        "time the anomaly (loss, pre-clip G2, AMP skips), then each layer's RMS and max",
        "`probewire explain` " + _p("deploy/explain/score.py"),
        "AMP GradScaler skips reach it (`step_metrics.skipped`) only when the scaler is "
        "passed to `s.gradients(scaler=)`",
    ),
    _full(
        "002 §4",
        "gradient metrics say unscaled or not, clipped or not, sharded or not",
        _p("instrument/catalog.py", "MetricSpec.point", "MetricSpec.replicated_over"),
    ),
    _part(
        "002 §4",
        "MoE metrics with valid tokens, top-k and the window; extremes beside the mean",
        _c("expert_balance.layer_tokens", "expert_stats.tokens"),
        "the router's k is not recorded with the counts",
    ),
)

_RECIPE = "training-recipe advice: probewire observes a run, it does not change the training"

_003: tuple[SeedItem, ...] = (
    _full(
        "003 §1",
        "a normal curve: training and held-out loss fall, then flatten",
        _f("step_metrics.loss") + ", " + _EVAL.format("`nll`, `bpb`"),
    ),
    _full(
        "003 §1",
        "loss explosion to NaN or Inf",
        _p("stream/signals.py", "_spikes") + ": a non-finite L or G2 pages",
    ),
    _part(
        "003 §1",
        "overfitting: training loss falls while held-out loss rises",
        _f("step_metrics.loss") + ", " + _EVAL.format("`nll`"),
        "both series are stored; no rule watches the gap between them",
    ),
    _part(
        "003 §1",
        "oscillation and plateau",
        _f("step_metrics.loss", "step_metrics.loss_z"),
        "upward spikes are scored; no rule for a sustained oscillation or a flat loss",
    ),
    _full(
        "003 §1",
        "EMA smoothing to read the trend",
        "optional smoothing beside the raw line " + _p("deploy/report/interactive.py"),
    ),
    _out("003 §1", "remedies: clipping, data filters, bfloat16, lower LR, warm-up", _RECIPE),
    _full(
        "003 §2",
        "perplexity = exp(cross-entropy), compared under one tokenizer",
        _EVAL.format("`ppl`") + ", " + _c("evaluations.tokenizer_version"),
    ),
    _full(
        "003 §2",
        "downstream accuracy on multiple-choice benchmarks",
        _EVAL.format("`accuracy`") + " (choice suite)",
    ),
    _part(
        "003 §2",
        "code generation pass@k by running unit tests",
        _EVAL.format("`pass@k`"),
        "pass@k uses a judge function; no sandboxed code-execution judge ships",
    ),
    _out(
        "003 §2",
        "BLEU / ROUGE",
        "not implemented: n-gram overlap does not judge correctness (the seed warns so itself)",
    ),
    _out(
        "003 §2",
        "human evaluation and LLM-as-a-judge",
        "needs people or a judge model; nothing may download at run time",
    ),
    _out(
        "003 §2",
        "light proxies between checkpoints (HellaSwag, LAMBADA)",
        "no such data ships and nothing downloads; the choice suite runs one given to it",
    ),
    _full("003 §3", "gradient L2 norm", _f("step_metrics.grad_norm")),
    _out("003 §3", "norm bands: healthy 0.1–10, exploding > 1000, vanishing < 1e-6", _STATIC),
    _full(
        "003 §3",
        "gradient clipping at max_norm",
        _f("step_metrics.clipped", "step_metrics.clip_rate")
        + " (c: the `max_norm` given to `s.clip_grad_norm_`, sent as `grad.clip_threshold`)",
    ),
    _part(
        "003 §3",
        "gradient histograms",
        _c("tensor_view.abs_max", "tensor_view.rms", "tensor_view.excess_kurtosis")
        + " (kind `grad`)",
        "moments and extremes per tensor, no histograms",
    ),
    _full(
        "003 §3",
        "layer-wise gradient comparison (a blocked middle layer)",
        _c("tensor_view.rms", "tensor_names.layer") + " (kind `grad`, per tensor)",
    ),
    _full(
        "003 §3",
        "long-tail outliers and dead (all-zero) gradients",
        _f("step_metrics.grad_abs_max", "step_metrics.grad_zero_frac")
        + ", "
        + _c("tensor_view.zero_frac"),
    ),
    _part(
        "003 §4",
        "weight histograms",
        _c("tensor_view.mean", "tensor_view.rms", "tensor_view.excess_kurtosis")
        + " (kind `param`)",
        "moments per tensor, no histograms",
    ),
    _part(
        "003 §4",
        "frozen parameters (no movement, LR 0, no gradient)",
        _f("step_metrics.update_ratio_min", "step_metrics.update_ratio_min_tensor")
        + ", "
        + _c("tensor_update_ratio.update_ratio")
        + ", "
        + _f("step_metrics.lr_groups"),
        "ρ per tensor shows a frozen tensor (ρ = 0) on scan steps; no rule flags it",
    ),
    _full(
        "003 §4",
        "residual drift: a block output's mean and spread grow",
        _c("tensor_view.mean", "tensor_view.rms") + " (kind `fwd`)",
    ),
    _full(
        "003 §4",
        "update magnitude Δθ = θ_t − θ_{t−1}",
        _c("tensor_view.rms") + " (kind `update`)",
    ),
    _part(
        "003 §4",
        "relative update Δθ/θ per layer, in its band 1e-3–1e-1",
        _c("tensor_update_ratio.update_ratio", "tensor_update_ratio.layer")
        + " (per tensor with its layer and role), "
        + _f("step_metrics.update_ratio_min", "step_metrics.update_ratio_max"),
        "per layer is a GROUP BY of the per-tensor view on retained scan steps; no "
        "per-layer ρ series is stored; " + _STATIC,
    ),
    _out(
        "003 §5",
        "TensorBoard, W&B, MLflow",
        "the store is ClickHouse; the views are `probewire report` and Grafana",
        _p("deploy/grafana/probewire-first-screen.json"),
    ),
    _part(
        "003 §5",
        "automatic record of hyper-parameters and code version",
        _c("runs.config") + ", the evaluation versions",
        "the code version and diff are not captured",
    ),
    _part(
        "003 §5",
        "system monitoring: GPU use, memory, CPU RAM and swap, network",
        _rm(Device.UTILIZATION, Device.MEMORY_USED, Host.RSS, Host.FAULTS_MAJOR)
        + ", "
        + _rm("net.*"),
        f"{_RETAINED}; swap is not measured (major page faults stand in); {_STATIC}",
    ),
    _part(
        "003 §6",
        "overfitting and underfitting diagnosis",
        _f("step_metrics.loss", "step_metrics.update_ratio") + ", " + _EVAL.format("`ppl`"),
        "read from the series; no rule for either",
    ),
    _part(
        "003 §6",
        "loss oscillation with G2 swinging",
        _f("step_metrics.cospike_count"),
        "a co-spike pages; a sustained oscillation without spikes has no rule",
    ),
    _part(
        "003 §6",
        "vanishing and exploding gradients",
        _f("step_metrics.grad_norm", "step_metrics.grad_z"),
        "explosion: non-finite values and co-spikes page; vanishing has no rule",
    ),
    _full(
        "003 §6",
        "slow training: throughput, utilisation, the bottleneck's kind",
        _f(
            "step_metrics.tokens_per_s",
            "step_metrics.compute_rate",
            "step_metrics.comm_wait_frac",
            "step_metrics.straggler_rank",
        ),
    ),
    _out("003 §6", "fixes and profilers (regularisation, FlashAttention, Nsight)", _RECIPE),
    _full(
        "003 §7",
        "a baseline: a small run first to check code and monitoring",
        "`probewire demo`, `probewire calibrate`",
    ),
    _full(
        "003 §7",
        "automatic alerts on a NaN loss or a gradient-norm anomaly",
        _p("stream/signals.py") + ", " + _p("stream/alerting.py"),
    ),
    _out(
        "003 §7",
        "save checkpoints regularly",
        "the training loop saves; probewire evaluates the checkpoints it is told about",
        _p("instrument/control.py", "checkpoint_event"),
    ),
    _part(
        "003 §7",
        "experiment version management",
        _c("runs.config", "evaluations.dataset_version"),
        "the code version is not recorded",
    ),
)

_004: tuple[SeedItem, ...] = (
    _part(
        "004 §1",
        "GPU memory used / total, alert at 90 %",
        _rm(Device.MEMORY_USED)
        + ", "
        + _f("step_metrics.memory_headroom", "step_metrics.memory_capacity_bytes"),
        "the share is stored as the headroom 1 − peak / capacity (the smallest over ranks); "
        + _STATIC,
    ),
    _part(
        "004 §1",
        "GPU utilisation (80 % good, under 60 % a bottleneck)",
        _rm(Device.UTILIZATION),
        f"{_RETAINED}; {_STATIC}",
    ),
    _out(
        "004 §1",
        "memory bandwidth and storage I/O (nvprof, iostat)",
        "needs a profiler or node monitoring; the probes measure the training process",
    ),
    _part(
        "004 §1",
        "host memory (available)",
        _rm(Host.RSS),
        "the process RSS only; the host's available memory is not measured",
    ),
    _full(
        "004 §1",
        "network bandwidth between nodes",
        _f("step_metrics.net_rx_bytes", "step_metrics.net_tx_bytes")
        + " (the bytes of the step's interval, summed over nodes; per node in "
        + _rm(Net.RX, Net.TX)
        + ")",
    ),
    _out(
        "004 §1",
        "point-to-point latency by send/recv pings (alert over 50 ms)",
        "a ping adds traffic and a host synchronisation on the training path (001 §5); the "
        "exposed wait of the loop's own collectives is measured instead",
        _f("step_metrics.comm_wait_frac"),
    ),
    _full(
        "004 §2",
        "training loss every batch",
        _f("step_metrics.loss") + " (unsmoothed, every step)",
    ),
    _full(
        "004 §2",
        "validation loss at a fixed interval, against the training loss",
        _EVAL.format("`nll`") + ", " + _p("evaluators/cadence.py"),
    ),
    _part(
        "004 §2",
        "loss volatility: std of the last N losses (over 10 %)",
        _p("stream/detect.py", "RobustSpikeDetector"),
        "the detectors keep a robust spread (MAD) internally; no standard-deviation series, "
        f"and {_STATIC}",
    ),
    _part(
        "004 §2",
        "gradient norm, alert on a sudden 10× rise",
        _f("step_metrics.grad_norm", "step_metrics.grad_z"),
        "the jump is scored and recorded as an anomaly; a G2 spike alone pages only when "
        "the loss spikes too or it is non-finite",
    ),
    _full(
        "004 §2",
        "clipping with clip_grad_norm_ at a threshold",
        _f("step_metrics.clipped", "step_metrics.clip_rate")
        + " (c: the `max_norm` given to `s.clip_grad_norm_`, sent as `grad.clip_threshold`)",
    ),
    _part(
        "004 §2",
        "share of parameters changed beyond a threshold (under 5 %: LR too small)",
        _f("step_metrics.update_ratio"),
        "the elements moved beyond a threshold are not counted; ρ (per tensor) measures "
        "the update's size instead",
    ),
    _full(
        "004 §2",
        "the learning rate actually applied",
        _f("step_metrics.lr", "step_metrics.lr_groups"),
    ),
    _part(
        "004 §2",
        "warm-up ramp and decay milestones as planned",
        _f("step_metrics.lr_groups"),
        "the rate is stored every step; no rule checks the schedule against its plan",
    ),
    _part(
        "004 §3",
        "validation accuracy / F1, a stall over 3 epochs",
        _EVAL.format("`accuracy`"),
        "no F1 and no stall rule",
    ),
    _full("004 §3", "perplexity in step with the loss", _EVAL.format("`ppl`")),
    _out("004 §3", "BLEU / ROUGE on generation", "not implemented (see 003 §2)"),
    _out(
        "004 §3",
        "data checks: length distribution, label balance, duplicates",
        "data-set checks belong to the data pipeline; the probes see per-step summaries only",
    ),
    _part(
        "004 §3",
        "parameter L2 norm and its spread over a window",
        _c("tensor_stats.sum_sq") + " (kind `param`, per tensor)",
        "no whole-model parameter norm series and no stability rule",
    ),
    _part(
        "004 §4",
        "layered monitoring: node, job and business layers",
        _p("deploy/grafana/probewire-first-screen.json") + ", " + _t("evaluations"),
        "no node-level layer (Prometheus); device and host telemetry come from the ranks",
    ),
    _out("004 §4", "static thresholds (memory over 90 %)", _STATIC),
    _part(
        "004 §4",
        "dynamic baselines (an ARIMA forecast of the last 7 days)",
        _p("stream/detect.py", "RobustSpikeDetector"),
        "the baseline is a rolling median and MAD over the last W steps, not a forecast",
    ),
    _full(
        "004 §4",
        "a loss rise with a gradient-norm anomaly: check the data first",
        _f("step_metrics.cospike") + ", `probewire explain`",
    ),
    _part(
        "004 §4",
        "dashboards: training, hardware, alerts by severity",
        _p("deploy/grafana/probewire-first-screen.json")
        + ", "
        + _p("deploy/grafana/probewire-rank.json")
        + ", "
        + _c("alerts.severity"),
        "no hardware board: device utilisation, power and temperature are not charted",
    ),
    _out(
        "004 §4",
        "sample the high-frequency metrics (1 %)",
        "every-step P0 series are cheap and kept whole: sampling would hide the short spikes "
        "001 §11 warns about",
    ),
    _full(
        "004 §4",
        "asynchronous writes through a Kafka buffer",
        _p("instrument/export.py", "KafkaTransport", "StepEmitter"),
    ),
    _part(
        "004 §4",
        "hot and cold data apart",
        "`*_recent` tables (1 day), " + _t("rank_metrics", "tensor_stats", "expert_stats"),
        "no cold tier on object storage",
    ),
    _part(
        "004 §5",
        "diagnosis when the loss rises, utilisation drops or evaluations swing",
        "`probewire explain` " + _p("deploy/explain/score.py"),
        "the walk covers loss, G2, step time, memory, experts and layers; evaluation swings "
        "and the remedies are not automated",
    ),
)

_WRITTEN: tuple[SeedItem, ...] = (*_000, *_001, *_002, *_003, *_004)

_SECTION = re.compile(r"^(\d{3})(?: §[\d, §-]+)?(?: (.+))?$")
_UNREVIEWED = "added from the registry row's seed; not reviewed against the seed yet"


def _with_registry(
    items: tuple[SeedItem, ...], rows: tuple[tuple[str, Series], ...]
) -> tuple[SeedItem, ...]:
    """``items`` with the registry rows they do not mention yet, each under the item its
    ``seed`` names (appended to that item's ``where``), else as an item of its own (partial
    until reviewed). A row citing a section only ("001 §4") is listed by hand."""
    out = list(items)
    for table, row in rows:
        column = f"`{table}.{row.name}`"
        match = _SECTION.match(row.seed)
        if not match or not match.group(2) or any(column in i.where for i in out):
            continue  # a section citation only, or already listed
        doc, item = match.group(1), match.group(2)
        at = next((k for k, i in enumerate(out) if i.doc == doc and i.item == item), None)
        if at is None:
            section = row.seed.removeprefix(doc).removesuffix(item).strip() or "§2"
            out.append(SeedItem(doc, section, item, Status.PARTIAL, column, _UNREVIEWED))
        else:
            out[at] = replace(out[at], where=f"{out[at].where}, {column}")
    return tuple(out)


SEED_ITEMS: tuple[SeedItem, ...] = _with_registry(_WRITTEN, _REGISTRY)


# ------------------------------------------------------------------ generated texts
def counts() -> dict[str, Counter[Status]]:
    """Per document (an item counts for every document it cites), the items per status."""
    return {doc: Counter(i.status for i in SEED_ITEMS if i.cites(doc)) for doc in DOCS}


def coverage() -> str:
    """The coverage line: items per status over the whole map."""
    total = Counter(i.status for i in SEED_ITEMS)
    parts = ", ".join(f"{total[s]} {s}" for s in Status)
    return f"Seed map: {len(SEED_ITEMS)} items of the five seeds: {parts}."


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _count_table() -> list[str]:
    lines = ["| seed | " + " | ".join(str(s) for s in Status) + " | items citing it |"]
    lines.append("|---" * (len(Status) + 2) + "|")
    for doc, found in counts().items():
        row = " | ".join(str(found[s]) for s in Status)
        lines.append(f"| {doc} | {row} | {sum(found.values())} |")
    return lines


def metric_table(doc: str) -> str:
    """The items of one document (by the document they are filed under), as markdown."""
    lines = ["| section | item | status | where | missing / why | also in |", "|---" * 6 + "|"]
    lines += [
        "| "
        + " | ".join(
            _cell(c) for c in (i.section, i.item, i.status, i.where, i.missing, ", ".join(i.also))
        )
        + " |"
        for i in SEED_ITEMS
        if i.doc == doc
    ]
    return "\n".join(lines)


def seed_map_doc() -> str:
    """docs/seed-map.md."""
    parts = [
        "# Seed map: every item of the five seeds",
        "",
        "Generated from `stream/seed_map.py` (`python -m probewire.stream.seed_map --write` "
        "rewrites it and the README's counts); `tests/unit/stream/test_seed_map.py` fails when this page "
        "differs. Status **full**: implemented as the seed defines it, `where` says where; "
        "**partial**: `missing` says what is not; **out of scope**: `missing` says why. "
        "Seed 000 summarizes 001: a 001 item it repeats names the 000 section under "
        "*also in*, and the table under 000 holds only what 000 adds. Formulas and rules "
        "in detail: [metrics.md](metrics.md).",
        "",
        *_count_table(),
        "",
        coverage(),
    ]
    for doc, title in DOCS.items():
        parts += ["", f"## {doc}: {title}", "", metric_table(doc)]
    return "\n".join(parts) + "\n"


def readme_summary() -> str:
    """The README's region between its metric-table markers."""
    return "\n".join(
        [*_count_table(), "", coverage() + " Every item: [docs/seed-map.md](docs/seed-map.md)."]
    )


README_BEGIN, README_END = "<!-- metric-table:begin -->\n", "\n<!-- metric-table:end -->"


def write(root: Path) -> str | None:
    """Rewrite ``root``/docs/seed-map.md and the README region; the error line, if any."""
    readme = root / "README.md"
    text = readme.read_text() if readme.is_file() else ""
    if README_BEGIN not in text or README_END not in text.split(README_BEGIN, 1)[1]:
        return f"{readme}: no metric-table markers; run from the repository root or name it"
    head, rest = text.split(README_BEGIN, 1)
    readme.write_text(
        head + README_BEGIN + readme_summary() + README_END + rest.split(README_END, 1)[1]
    )
    (root / "docs").mkdir(exist_ok=True)
    (root / "docs" / "seed-map.md").write_text(seed_map_doc())
    return None


def main(argv: list[str]) -> int:
    """``[--doc | --readme | --write [ROOT]]``: print a text, or rewrite both files."""
    texts = {"--doc": seed_map_doc, "--readme": readme_summary, "": coverage}
    arg = argv[0] if argv else ""
    if arg == "--write" and len(argv) <= 2:
        error = write(Path(argv[1] if len(argv) == 2 else "."))
        print(error or coverage(), file=sys.stderr if error else sys.stdout)
        return 2 if error else 0
    if arg not in texts or len(argv) > 1:
        usage = "python -m probewire.stream.seed_map [--doc | --readme | --write [ROOT]]"
        print(f"unknown arguments {argv}: run {usage}", file=sys.stderr)
        return 2
    print(texts[arg](), end="" if arg == "--doc" else "\n")
    return 0


if __name__ == "__main__":  # pragma: no cover - the command line; main() is tested
    sys.exit(main(sys.argv[1:]))
