"""``StructureConfig``: which model-structure observation points ``attach`` looks for.

Torch-free, like ``config``. Every pattern is a regular expression matched in full against
module names with wrapper prefixes removed (``registry.label_name``). The defaults cover
the demo model and the common Hugging Face names (Llama/Mistral/Mixtral/Qwen, GPT-2,
DeepSeek MLA); discovery never changes model code.

Cadence follows the monitor's priorities (``ProbeConfig.cadence``), probe by probe, like
the tensor scans (a probe's metrics ride along with it, whatever their catalog priority):

=========================  ========  ====================================================
probe                      priority  metrics
=========================  ========  ====================================================
expert counts              P0        moe.expert_tokens
modality token counts      P0        modality.tokens
residual paths             P1        residual.* (R_b is catalog-P0 at cadence 100, as
                                     tensor.abs_max is)
gates                      P1        residual.gate_closed, residual.gate_channels
media scale                P1        modality.media_*/text_* (γ, catalog-P0 at cadence 100)
encoder gradient share     P1        modality.encoder_grad_sq, all_grad_sq, *_params
MTP agreement              P1        output.mtp_positions, output.mtp_agree
BOS value gradient         P1        attn.bos_value_grad_*, attn.value_grad_*
router detail              P2        moe.router_bias, moe.topk_margin_*, moe.expert_bias_abs_sum
per-module views           P2        module.grad_*, module.act_*
=========================  ========  ====================================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DEFAULT_GATE_THRESHOLDS", "StructureConfig"]

DEFAULT_GATE_THRESHOLDS: tuple[float, ...] = (0.05, 0.1, 0.25)
"""θ of the gate-saturation fraction (seeds 001 §8)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StructureConfig:
    """Model-structure probes of ``attach`` (see the module docstring). Checks name the field."""

    enabled: bool = True
    """False: no structure probe is discovered or registered."""
    blocks: str = r"(.*\.)?(layers|blocks|h|layer)\.(\d+)"
    """Transformer blocks; the last group is the layer index (label ``layer``)."""
    attn_children: tuple[str, ...] = ("attn", "self_attn", "attention", "self_attention")
    """Names of a block's attention branch (its output is the branch output b)."""
    mlp_children: tuple[str, ...] = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe")
    """Names of a block's feed-forward / MoE branch."""
    routers: str = r"(.*\.)?(mlp|feed_forward|ffn|block_sparse_moe|moe)\.(gate|router)"
    """MoE routers: output (logits, ..., top-k expert ids) or logits [N, E]."""
    router_bias: tuple[str, ...] = ("expert_bias", "e_score_correction_bias", "bias")
    """Parameter or buffer names of a router's expert-selection bias."""
    branch_gates: str = r"(.*\.)?(branch_gate|residual_gate)"
    """Learned per-channel residual-branch gates σ(g/T): first 1-D parameter g, attribute
    ``temperature`` (default 1)."""
    gate_scores: str = r"(.*\.)?(attn|self_attn|attention)\.(gate_score|gate_scores)"
    """Gated attention: a module whose output is the sigmoid gate scores."""
    embedding: str = r"(.*\.)?(embed|embed_tokens|wte|tok_embeddings|word_embeddings)"
    """The text token embedding (text side of γ, text token count)."""
    projector: str = r"(.*\.)?(projector|mm_projector|multi_modal_projector|media_projector)"
    """The media projector (media side of γ). Its output [B, M, d] is the media tokens; a
    bool token mask [B, M] passed as its second argument (or ``token_mask=``) marks the
    present ones. Without a projector no modality probe is registered."""
    encoder: str = (
        r"(.*\.)?(encoder|vision_tower|vision_model|visual|image_encoder|"
        r"media_encoder)"
    )
    """The media encoder (S_enc numerator); only looked for when a projector exists."""
    mtp_heads: str = r"(.*\.)?mtp\.(\d+)"
    """Multi-token-prediction heads whose output is logits; depth = index + 1."""
    fused_qkv: tuple[str, ...] = ("qkv", "c_attn", "Wqkv")
    """Fused projections laid out [Q | K | V] in equal thirds of the output features."""
    bos_id: int | None = None
    """BOS token id; None: ``model.bos_id`` or ``model.config.bos_token_id``."""
    gate_thresholds: tuple[float, ...] = DEFAULT_GATE_THRESHOLDS

    def __post_init__(self) -> None:
        for name in (
            "blocks",
            "routers",
            "branch_gates",
            "gate_scores",
            "embedding",
            "projector",
            "encoder",
            "mtp_heads",
        ):
            pattern = getattr(self, name)
            if not isinstance(pattern, str):
                raise ValueError(f"StructureConfig.{name}: must be a pattern string")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(
                    f"StructureConfig.{name}: bad pattern {pattern!r}: {exc}"
                ) from None
        for name in ("attn_children", "mlp_children", "router_bias", "fused_qkv"):
            value = getattr(self, name)
            if (
                isinstance(value, str)
                or not isinstance(value, tuple)
                or not all(isinstance(v, str) and v for v in value)
            ):
                raise ValueError(f"StructureConfig.{name}: must be a tuple of names")
        thresholds = self.gate_thresholds
        if (
            not thresholds
            or not all(isinstance(t, float) and 0 < t < 1 for t in thresholds)
            or len(set(thresholds)) != len(thresholds)
        ):
            raise ValueError("StructureConfig.gate_thresholds: distinct floats in (0, 1)")
        if self.bos_id is not None and (not isinstance(self.bos_id, int) or self.bos_id < 0):
            raise ValueError("StructureConfig.bos_id: must be an int >= 0 or None")
