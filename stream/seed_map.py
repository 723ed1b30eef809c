"""Every item of seeds 001 and 002 with where it is stored: the README's metric table is
generated from this list (``metric_table``; a unit test holds the README equal to it), and
``python -m probewire.stream.seed_map`` prints the coverage count.

An item is *formed* when a stored column or view holds the number the seed defines; it is
*components* when only its reducible components are stored (per rank, in
``rank_metrics``), so a reader forms it in SQL. The written list below names where each
item is stored; a registry row (``series``) whose ``seed`` names an item ("002
moe/maxvio.mean (.max)") and that the list does not mention yet is added to that item's
stored columns (or becomes an item of its own), so a new series needs no edit here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .series import FORMED, STEP_SERIES, Series

__all__ = ["SEED_ITEMS", "SeedItem", "coverage", "metric_table"]


@dataclass(frozen=True, slots=True)
class SeedItem:
    seed: str
    item: str
    stored: str
    formed: bool = True


def _f(*columns: str) -> str:
    """``table.column`` of registry series (checked against the registry at import)."""
    known = {f"{s.table}.{s.column}" for s in FORMED} | {f"step_metrics.{s}" for s in STEP_SERIES}
    unknown = [c for c in columns if c not in known]
    if unknown:
        raise ValueError(f"not in the registry (stream.series): {unknown}")
    return ", ".join(f"`{c}`" for c in columns)


_RM = "`rank_metrics` ({})"
_WRITTEN: tuple[SeedItem, ...] = (
    SeedItem("001 §3", "global mean loss L", "`step_metrics.loss`"),
    SeedItem(
        "001 §3", "local mean loss L_r", _RM.format("loss.sum / loss.tokens per rank"), formed=False
    ),
    SeedItem("001 §3", "worst-rank loss L_max", "`step_metrics.loss_worst_rank`, `_id`"),
    SeedItem("001 §3", "loss by source and modality", "`source_metrics.loss`"),
    SeedItem("001 §3, §9", "token share π", "`source_metrics.token_share`"),
    SeedItem("001 §4", "global gradient norm G2", "`step_metrics.grad_norm`"),
    SeedItem("001 §4", "clip rate", "`step_metrics.clip_rate`, `clipped`"),
    SeedItem(
        "001 §4",
        "co-spike count and magnitude",
        "`step_metrics.cospike_count`, `cospike_magnitude`",
    ),
    SeedItem("001 §4", "robust spike score z_t", "`step_metrics.loss_z`, `grad_z`"),
    SeedItem(
        "001 §4",
        "mean and max |g| (G_mean, G_max)",
        _f("step_metrics.grad_abs_mean", "step_metrics.grad_abs_max"),
    ),
    SeedItem("001 §4", "gradient zero fraction Z_g", _f("step_metrics.grad_zero_frac")),
    SeedItem(
        "001 §4",
        "G_mean, G_max, Z_g per group (embeddings, experts apart)",
        _f(
            "grad_group_stats.grad_abs_mean",
            "grad_group_stats.grad_abs_max",
            "grad_group_stats.grad_zero_frac",
        ),
    ),
    SeedItem(
        "001 §4",
        "skip and replay counters",
        "`step_metrics.skipped`, `replayed`, `replay_mismatch` (cumulative), `*_step` (this step)",
    ),
    SeedItem("001 §5", "step time, throughput", "`step_metrics.step_time_s`, `tokens_per_s`"),
    SeedItem("001 §5", "compute rate Φ", "`step_metrics.compute_rate`"),
    SeedItem("001 §5", "straggler score S", "`step_metrics.straggler_score`, `straggler_rank`"),
    SeedItem("001 §5", "peak memory, max over ranks", "`step_metrics.peak_memory_bytes`"),
    SeedItem(
        "001 §5", "allocated and reserved memory", _RM.format("memory.allocated, memory.reserved")
    ),
    SeedItem("001 §5", "exposed collective wait W_comm", _f("step_metrics.comm_wait_frac")),
    SeedItem("001 §5", "device and host telemetry", _RM.format("device.*, host.*, net.*")),
    SeedItem("001 §6", "absolute maximum", "`tensor_view.abs_max`, `step_metrics.output_absmax`"),
    SeedItem("001 §6", "RMS and absolute mean", "`tensor_view.rms`, `abs_mean`"),
    SeedItem("001 §6", "zero fraction Z_x", "`tensor_view.zero_frac`"),
    SeedItem("001 §6", "relative update size ρ", _f("step_metrics.update_ratio")),
    SeedItem("001 §6", "excess kurtosis κ", "`tensor_view.excess_kurtosis`"),
    SeedItem(
        "001 §6",
        "optimizer chain",
        "`tensor_view` (kind opt_grad, opt_normalized, opt_direction, update)",
    ),
    SeedItem("001 §7", "MaxVio, imbalance ratio I", "`step_metrics.moe_maxvio`, `expert_balance`"),
    SeedItem("001 §7", "shard imbalance", "`step_metrics.moe_shard_imbalance`"),
    SeedItem("001 §7", "normalized routing entropy H_norm", "`step_metrics.moe_h_norm`"),
    SeedItem("001 §7", "per-expert load", "`expert_stats.tokens`"),
    SeedItem(
        "001 §7",
        "router bias terms, top-k margins",
        _RM.format("moe.router_bias, moe.topk_margin_*"),
        formed=False,
    ),
    SeedItem(
        "001 §8",
        "relative branch scale R_b (with N_s, N_b)",
        "`step_metrics.residual_ratio_min`, `residual_stream_norm`, `residual_branch_norm`",
    ),
    SeedItem(
        "001 §8",
        "block importance B, angle A",
        _RM.format("residual.importance_*, residual.angle_*"),
        formed=False,
    ),
    SeedItem("001 §8", "bfloat16 no-op fraction", _RM.format("residual.noop_*"), formed=False),
    SeedItem(
        "001 §8",
        "gate saturation fraction",
        _RM.format("residual.gate_closed, residual.gate_channels"),
        formed=False,
    ),
    SeedItem("001 §9", "media scale ratio γ", "`step_metrics.media_scale`"),
    SeedItem("001 §9", "encoder gradient share S_enc", _f("step_metrics.encoder_grad_share")),
    SeedItem("001 §10", "held-out NLL, bits per byte", "`evaluations` (nll, bpb)"),
    SeedItem("001 §10", "choice accuracy", "`evaluations` (accuracy)"),
    SeedItem("001 §10", "greedy generation", "`evaluations` (exact_match)"),
    SeedItem("001 §10", "media gain", "`evaluations` (media_gain)"),
    SeedItem("001 §10", "pass@k", "`evaluations` (pass_at_k)"),
    SeedItem("001 §10", "IoU", "`evaluations` (grounding)"),
    SeedItem("001 §10", "averaged-weight evaluation", "`evaluations` (weights_stream ema)"),
    SeedItem("002", "act/output_layer_logits_rms.avg", _f("step_metrics.logits_rms")),
    SeedItem("002", "moe/dead_expert_ratio", _f("step_metrics.dead_expert_ratio")),
    SeedItem(
        "002",
        "bos_value_grad_...",
        _f("step_metrics.bos_value_grad_rms", "step_metrics.bos_value_grad_ratio"),
    ),
    SeedItem("002", "act/output_layer_logits_abs.max", "`step_metrics.output_absmax`"),
    SeedItem("002", "act/output_layer_logits_top2_diff.avg", _f("step_metrics.top2_gap_mean")),
    SeedItem("002", "act/output_layer_logits_top2_equal_ratio", _f("step_metrics.top2_tie_frac")),
    SeedItem("002", "act/hidden_states_abs.max", "`tensor_view.abs_max` (kind fwd)"),
    SeedItem("002", "act/hidden_states_rms.avg", "`tensor_view.rms` (kind fwd)"),
    SeedItem("002", "act/mtp_{k}_lm_head_top1_agreement", _f("step_metrics.mtp_agreement")),
    SeedItem(
        "002",
        "moe/maxvio.mean (.max)",
        "`step_metrics.moe_maxvio` (max), `expert_balance.max_violation` (per layer)",
    ),
    SeedItem("002", "moe/ep_bias_abs_sum", _f("step_metrics.ep_bias_abs_sum")),
    *(
        SeedItem("002", name, _RM.format(comp), formed=False)
        for name, comp in (
            ("grad/word_embeddings_abs.max", "module.grad_abs_max{module=embedding}"),
            ("grad/output_layer_abs.max", "module.grad_abs_max{module=output}"),
            ("grad/Wq_abs.max (Wk, Wv)", "module.grad_abs_max{module=q, k, v}"),
            ("grad/Wo_abs.max", "module.grad_abs_max{module=o}"),
            ("grad/mla_Q_up_abs.max (Q_down, KV_up, ...)", "module.grad_abs_max{module=q_up, ...}"),
            ("grad/W_gate_rms (W_up, W_down)", "module.grad_sum_sq, module.grad_n"),
            ("grad/{name}_rms (layer norms)", "module.grad_sum_sq, module.grad_n{module=norm_*}"),
            (
                "act/attn_out_before_proj_rms.avg",
                "module.act_sum_sq, module.act_n{module=attn_core}",
            ),
            ("act/gate_scores_rms.avg", "module.act_sum_sq, module.act_n{module=gate_score}"),
        )
    ),
)


_SECTION = re.compile(r"^(\d{3})(?: §[\d, §-]+)?(?: (.+))?$")


def _with_registry(items: tuple[SeedItem, ...], rows: tuple[Series, ...]) -> tuple[SeedItem, ...]:
    """``items`` with the registry rows they do not mention yet, each under the item its
    ``seed`` names (appended to that item's stored columns), else as an item of its own."""
    out = list(items)
    for row in rows:
        column = f"`step_metrics.{row.name}`"
        match = _SECTION.match(row.seed)
        if not match or not match.group(2) or any(column in i.stored for i in out):
            continue  # a section citation only, or already listed
        doc, item = match.group(1), match.group(2)
        at = next((k for k, i in enumerate(out) if i.seed.startswith(doc) and i.item == item), None)
        if at is None:
            out.append(SeedItem(doc, item, column))
        else:
            out[at] = replace(out[at], stored=f"{out[at].stored}, {column}")
    return tuple(out)


SEED_ITEMS: tuple[SeedItem, ...] = _with_registry(_WRITTEN, STEP_SERIES)


def coverage() -> tuple[int, int]:
    """(seed items formed into a stored series, all seed items)."""
    return sum(i.formed for i in SEED_ITEMS), len(SEED_ITEMS)


def metric_table() -> str:
    """The README's metric table (markdown), coverage line included."""
    formed, total = coverage()
    lines = ["| seed | item | stored as | formed |", "|---|---|---|---|"]
    lines += [
        f"| {i.seed} | {i.item} | {i.stored} | {'yes' if i.formed else 'components'} |"
        for i in SEED_ITEMS
    ]
    lines.append(
        f"\nCoverage: {formed} of {total} seed items formed into a stored series; "
        f"the other {total - formed} are stored as their per-rank components."
    )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover - the coverage count for the README and reports
    print(metric_table().splitlines()[-1].strip())
