"""The stored series the stream forms from the catalog's components (issue 18): per series,
where it is stored, the components it is formed from and the seed item it answers. Its
cadence is its components' catalog tier (``catalog.tier_of``): a series exists on the
steps where its components are measured. Torch-free; the README's metric table and the
demo's end-to-end test read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .catalog import Attn, Comm, Grad, Modality, Moe, Output, System, Tensor, Tier, tier_of

__all__ = ["FORMED", "Series"]


@dataclass(frozen=True, slots=True)
class Series:
    table: str
    column: str
    components: tuple[str, ...]  # catalog names
    seed: str

    @property
    def tier(self) -> Tier:
        return tier_of(*self.components)


_G = (Grad.ABS_SUM, Grad.ABS_MAX, Grad.ZEROS, Grad.ELEMENTS, Grad.NONFINITE)
_TOP2 = (Output.POSITIONS, Output.TOP2_GAP_SUM, Output.TOP2_EQUAL)
_BOS = (Attn.BOS_SUM_SQ, Attn.BOS_N)
_SM, _GG = "step_metrics", "grad_group_stats"

FORMED: tuple[Series, ...] = (
    Series(_SM, "grad_abs_mean", _G, "001 §4 mean absolute gradient G_mean"),
    Series(_SM, "grad_abs_max", _G, "001 §4 maximum absolute gradient G_max"),
    Series(_SM, "grad_zero_frac", _G, "001 §4 gradient zero fraction Z_g"),
    Series(_GG, "grad_abs_mean", _G, "001 §4 G_mean per group (embeddings, experts apart)"),
    Series(_GG, "grad_abs_max", _G, "001 §4 G_max per group"),
    Series(_GG, "grad_zero_frac", _G, "001 §4 Z_g per group"),
    Series(
        _SM,
        "comm_wait_frac",
        (Comm.WAIT, System.STEP_TIME),
        "001 §5 exposed collective wait W_comm",
    ),
    Series(_SM, "update_ratio", (Tensor.SUM_SQ,), "001 §6 relative update size ρ"),
    Series(
        _SM,
        "logits_rms",
        (Output.LOGITS_SUM_SQ, Output.LOGITS_N),
        "002 act/output_layer_logits_rms.avg",
    ),
    Series(_SM, "top2_gap_mean", _TOP2, "002 act/output_layer_logits_top2_diff.avg"),
    Series(_SM, "top2_tie_frac", _TOP2, "002 act/output_layer_logits_top2_equal_ratio"),
    Series(_SM, "dead_expert_ratio", (Moe.EXPERT_TOKENS,), "002 moe/dead_expert_ratio"),
    Series(
        _SM,
        "encoder_grad_share",
        (Modality.ENCODER_GRAD_SQ, Modality.ALL_GRAD_SQ),
        "001 §9 encoder gradient share S_enc",
    ),
    Series(
        _SM,
        "mtp_agreement",
        (Output.MTP_AGREE, Output.MTP_POSITIONS),
        "002 act/mtp_{k}_lm_head_top1_agreement",
    ),
    Series(_SM, "bos_value_grad_rms", _BOS, "002 bos_value_grad_..."),
    Series(
        _SM,
        "bos_value_grad_ratio",
        (*_BOS, Attn.VALUE_SUM_SQ, Attn.VALUE_N),
        "002 bos_value_grad_... (against the other positions)",
    ),
    Series(_SM, "ep_bias_abs_sum", (Moe.BIAS_ABS_SUM,), "002 moe/ep_bias_abs_sum"),
)
