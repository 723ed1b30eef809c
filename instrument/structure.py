"""Per-token structure statistics: residual paths, experts, output layer, modality.

Pure torch. Device-side functions return small tensors on the input's device and never
synchronise the host (no ``.item()``, no boolean-mask indexing, no data-dependent shapes).
Host-side functions (``summarize_*``, ``media_scale``, ``token_shares``,
``encoder_grad_share``) run after the batched device-to-host copy and the cross-rank
reduction, and return ``None`` where no valid token was measured.

Per-token statistics ship as a token block (``TokenField``)::

    COUNT  valid tokens            reduce: sum
    SUM    Σ value over them       reduce: sum   (mean = SUM / COUNT)
    P90    90th percentile         rank-local    (linear interpolation, numpy's default)
    P99    99th percentile         rank-local
    MAX    maximum                 reduce: max

Quantiles are taken over tokens, never over the flattened tokens × features (seeds §8,
"Aggregation"). They do not combine exactly across ranks: the stream may bound them with
a maximum over ranks, and must never average them.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from probewire.instrument.scan import ScanFields, scan

__all__ = [
    "GATE_THRESHOLDS", "ROW_CHUNK_ELEMS", "ExpertLoad", "LogitsField", "LogitsSummary",
    "MediaField", "MediaScale", "ResidualStat", "ResidualSummary", "TokenField",
    "TokenSummary", "encoder_grad_share", "encoder_grad_share_components",
    "expert_bias_abs_sum", "expert_token_counts", "gate_saturation",
    "logits_stats", "media_scale", "media_scale_components", "modality_token_counts",
    "mtp_top1_agreement", "residual_stats", "residual_token_values", "summarize_expert_counts",
    "summarize_gate_saturation", "summarize_logits", "summarize_mtp_agreement",
    "summarize_residual", "summarize_tokens", "token_quantiles", "token_shares", "topk_margin",
]  # fmt: skip

GATE_THRESHOLDS: tuple[float, ...] = (0.05, 0.1, 0.25)
"""Gate-saturation thresholds θ tracked by default (seeds §8)."""
ROW_CHUNK_ELEMS = 1 << 22
"""Default elements per row block for [tokens, features] inputs; bounds float32 temporaries."""


class TokenField(enum.IntEnum):
    """Columns of a token block (module docstring)."""

    COUNT, SUM, P90, P99, MAX = range(5)


class ResidualStat(enum.IntEnum):
    """Rows of ``residual_stats``, columns of ``residual_token_values`` (seeds §8)."""

    STREAM_NORM = 0  # N_s = ‖s‖₂
    BRANCH_NORM = 1  # N_b = ‖b‖₂
    BRANCH_RATIO = 2  # R_b = N_b / (N_s + ε)
    BLOCK_IMPORTANCE = 3  # B = 1 − cos(s, a)
    ANGLE = 4  # A = arccos(cos(s, a)) / π
    NOOP_FRAC = 5  # F_noop


class LogitsField(enum.IntEnum):
    """Fields of ``logits_stats`` (002, output layer); all add across ranks but ABS_MAX (max)."""

    TOKENS, ELEMENTS, SUM_SQ, ABS_MAX, NONFINITE, GAP_TOKENS, GAP_SUM, TIES = range(8)


class MediaField(enum.IntEnum):
    """Fields of ``media_scale_components`` (seeds §9); all add across ranks."""

    MEDIA_SUM_SQ, MEDIA_ELEMENTS, TEXT_SUM_SQ, TEXT_ELEMENTS = range(4)


# ------------------------------------------------------------------------ token quantiles
def token_quantiles(values: torch.Tensor, valid: torch.Tensor, *,
                    method: str = "linear") -> torch.Tensor:
    """Token block(s) of per-token ``values`` [T] or [T, C] over tokens with ``valid`` [T].

    Returns float64 [5] (or [C, 5]) in ``TokenField`` order. The q-quantile interpolates
    linearly between the order statistics around rank q·(n − 1) of the n valid tokens
    (``method="linear"``, numpy's default) or takes the upper one of them
    (``method="higher"``, numpy's "higher": the order statistic at index ⌈q·(n − 1)⌉).
    "higher" is what a rank ships when the stream bounds the global quantile by the
    maximum over ranks: at least q·n_r of rank r's tokens lie at or below its value, so
    the maximum over ranks is an upper bound of the global quantile (linear or higher);
    interpolated rank values are not (ranks {0, 10} and {0, 10}: 9 each, global 10).
    Invalid tokens are set to NaN, which ``sort`` places last, so they never enter. With
    n = 0 the block has COUNT = 0 and its other fields mean nothing.
    """
    if method not in ("linear", "higher"):
        raise ValueError(f"method must be 'linear' or 'higher', got {method!r}")
    flat = values.detach().reshape(values.shape[0], math.prod(values.shape[1:])).to(torch.float64)
    if flat.shape[0] == 0:
        block = flat.new_zeros((flat.shape[1], len(TokenField)))
        return block[0] if values.dim() == 1 else block
    mask = valid.reshape(-1, 1)
    count = valid.sum()
    total = torch.where(mask, flat, 0.0).sum(dim=0)
    peak = torch.where(mask, flat, -math.inf).amax(dim=0)
    ordered = torch.where(mask, flat, math.nan).sort(dim=0).values
    last = (count - 1).clamp(min=0)
    p90, p99 = (_sorted_quantile(ordered, last, q, method == "higher") for q in (0.90, 0.99))
    block = torch.stack([count.to(torch.float64).expand_as(total), total, p90, p99, peak], -1)
    return block[0] if values.dim() == 1 else block


def _sorted_quantile(ordered: torch.Tensor, last: torch.Tensor, q: float,
                     higher: bool = False) -> torch.Tensor:
    position = last.to(torch.float64) * q
    low = position.floor()
    frac = position - low
    low_i = low.long().expand(1, ordered.shape[1])
    lo = ordered.gather(0, low_i)[0]
    hi = ordered.gather(0, torch.minimum(low_i + 1, last))[0]
    if higher:
        return torch.where(frac > 0, hi, lo)
    return torch.where(frac > 0, lo + frac * (hi - lo), lo)


def summarize_tokens(block: torch.Tensor | Sequence[float]) -> TokenSummary | None:
    """``TokenSummary`` of one token block; ``None`` when it counted no valid token."""
    count, total, p90, p99, peak = _host_list(block)
    if count == 0:
        return None
    return TokenSummary(count=int(count), mean=total / count, p90=p90, p99=p99, max=peak)


@dataclass(frozen=True, slots=True)
class TokenSummary:
    """Host-side token block: count, mean, p90, p99 and max over valid tokens."""

    count: int
    mean: float
    p90: float
    p99: float
    max: float


# ------------------------------------------------------------------ residual paths (§8)
def residual_token_values(
    stream: torch.Tensor, branch: torch.Tensor, *, eps: float = 1e-12,
    chunk_elems: int = ROW_CHUNK_ELEMS,
) -> torch.Tensor:
    """Per-token residual statistics, float32 [T, 6] in ``ResidualStat`` order (seeds §8).

    Measurement point: a block's residual add a = s + b, s [T, d] the incoming stream and
    b [T, d] the branch output (rows processed in blocks of ``chunk_elems`` elements).
    Per token: N_s = ‖s‖₂, N_b = ‖b‖₂, R_b = N_b/(N_s+ε); cos(s, a) = sᵀa/(‖s‖‖a‖+ε),
    B = 1 − cos, A = arccos(clamp(cos, −1, 1))/π;
    F_noop = (1/d) Σ_j 1[Q_bf16(s_j + b_j) = Q_bf16(s_j) ∧ b_j ≠ 0].

    Arithmetic is float32. B is evaluated as (‖s‖‖a‖·½‖ŝ − â‖² + ε)/(‖s‖‖a‖ + ε) with unit
    vectors ŝ, â: algebraically 1 − cos, but it keeps relative accuracy when a block barely
    turns the stream, where 1 − cos cancels down to float32 resolution (~6e-8). A uses
    arccos(1 − B) = 2·asin(√(B/2)) for the same reason. F_noop adds s + b in float32 and
    rounds once to bfloat16, as a bf16 residual add does: for bf16 inputs that is the
    correctly rounded sum; for float32 inputs a double rounding can flip a rare bf16 tie.
    """
    if stream.shape != branch.shape:
        raise ValueError(f"stream {tuple(stream.shape)} and branch {tuple(branch.shape)} differ")
    d = stream.shape[-1]
    s_rows, b_rows = stream.detach().reshape(-1, d), branch.detach().reshape(-1, d)
    step = max(1, chunk_elems // max(d, 1))
    blocks = [
        _residual_block(s_rows[i : i + step], b_rows[i : i + step], eps)
        for i in range(0, s_rows.shape[0], step)
    ]
    if not blocks:
        return s_rows.new_zeros((0, len(ResidualStat)), dtype=torch.float32)
    return torch.cat(blocks)


def _residual_block(s_in: torch.Tensor, b_in: torch.Tensor, eps: float) -> torch.Tensor:
    s, b = s_in.float(), b_in.float()
    a = s + b
    noop = ((a.to(torch.bfloat16) == s_in.to(torch.bfloat16)) & (b != 0)).float().mean(-1)
    n_s, n_b, n_a = (torch.linalg.vector_norm(t, dim=-1) for t in (s, b, a))
    tiny = torch.finfo(torch.float32).tiny
    chord = s / n_s.clamp_min(tiny)[:, None] - a / n_a.clamp_min(tiny)[:, None]
    one_minus_cos = 0.5 * torch.linalg.vector_norm(chord, dim=-1).square()
    product = n_s * n_a
    importance = ((product * one_minus_cos + eps) / (product + eps)).clamp(0.0, 2.0)
    angle = 2.0 * torch.asin(torch.sqrt(importance / 2.0)) / math.pi
    return torch.stack([n_s, n_b, n_b / (n_s + eps), importance, angle, noop], dim=-1)


def residual_stats(
    stream: torch.Tensor, branch: torch.Tensor, valid: torch.Tensor, *, eps: float = 1e-12,
    chunk_elems: int = ROW_CHUNK_ELEMS,
) -> torch.Tensor:
    """Token blocks of the residual statistics, float64 [6, 5] (§8: R_b P0; B, A, F_noop P1).

    Rows in ``ResidualStat`` order, columns in ``TokenField`` order; tokens with ``valid``
    [T] false (padding) are excluded. Formulas: ``residual_token_values``.
    """
    values = residual_token_values(stream, branch, eps=eps, chunk_elems=chunk_elems)
    return token_quantiles(values, valid.reshape(-1))


def gate_saturation(
    gate: torch.Tensor, valid: torch.Tensor | None = None, *, temperature: float = 1.0,
    thresholds: Sequence[float] = GATE_THRESHOLDS,
) -> torch.Tensor:
    """Token blocks of F_gate(θ) = (1/d) Σ_j 1[σ(g_j/T) < θ], float64 [len(θ), 5] (§8, P1).

    Measurement point: the gate logits g of a gated branch, either one per channel ([d]:
    one row, COUNT = 1, no mask) or one per token and channel ([T, d] with ``valid`` [T]).
    """
    beta = torch.sigmoid(gate.detach().reshape(-1, gate.shape[-1]).float() / temperature)
    values = torch.stack([(beta < theta).float().mean(dim=-1) for theta in thresholds], dim=-1)
    if valid is None:
        if gate.dim() != 1:
            raise ValueError("a per-token gate needs a valid mask")
        valid = torch.ones(1, dtype=torch.bool, device=gate.device)
    return token_quantiles(values, valid.reshape(-1))


@dataclass(frozen=True, slots=True)
class ResidualSummary:
    """Host-side residual statistics of one block (seeds §8)."""

    stream_norm: TokenSummary
    branch_norm: TokenSummary
    branch_ratio: TokenSummary
    block_importance: TokenSummary
    angle: TokenSummary
    noop_frac: TokenSummary


def summarize_residual(blocks: torch.Tensor) -> ResidualSummary | None:
    """``ResidualSummary`` of (reduced) ``residual_stats``; ``None`` without valid tokens."""
    rows = _summarize_rows(blocks)
    return ResidualSummary(*rows) if rows is not None else None


def summarize_gate_saturation(
    blocks: torch.Tensor, thresholds: Sequence[float] = GATE_THRESHOLDS
) -> dict[float, TokenSummary] | None:
    """θ → ``TokenSummary`` of F_gate(θ) from ``gate_saturation``; ``None`` without valid rows."""
    rows = _summarize_rows(blocks)
    return dict(zip(thresholds, rows, strict=True)) if rows is not None else None


# -------------------------------------------------------------------- experts (§7, 002)
def expert_token_counts(
    topk_indices: torch.Tensor, valid: torch.Tensor, n_experts: int
) -> torch.Tensor:
    """Valid tokens routed to each expert c_i, int64 [E] (§7: MaxVio, I P0; H_norm P1).

    Measurement point: the router's chosen expert ids [..., k] of one MoE layer and
    micro-batch. A token counts once for each of its k experts (Σ c_i = k · valid tokens).
    Invalid tokens (``valid`` [...] false, e.g. padding) add nothing whatever index they
    carry; a valid index outside [0, E) is an error.
    """
    k = topk_indices.shape[-1]
    return _masked_bincount(topk_indices.reshape(-1, k), valid.reshape(-1), n_experts)


def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per-token gap s_(k) − s_(k+1) of the k-th and (k+1)-th score, float32 [T] (§7, P2).

    ``scores`` [..., E] are whatever the router ranks to select experts (logits,
    probabilities, or bias-adjusted scores). Summarise with ``token_quantiles(m, valid)``.
    """
    if not 1 <= k < scores.shape[-1]:
        raise ValueError(f"need 1 <= k < n_experts, got k={k}, n_experts={scores.shape[-1]}")
    top = scores.detach().reshape(-1, scores.shape[-1]).float().topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k]


def expert_bias_abs_sum(bias: torch.Tensor) -> torch.Tensor:
    """Σ_i |bias_i| of a router's expert bias, float64 0-dim (002, moe/ep_bias_abs_sum)."""
    return bias.detach().to(torch.float64).abs().sum()


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """Host-side expert balance (seeds §7) from rank-summed loads c_i.

    imbalance I = max_i c_i / c̄ with c̄ = Σc/E; max_violation = I − 1; entropy
    H = −Σ p_i log p_i with p_i = c_i/Σc (0·log 0 = 0); entropy_norm = H/log E (``None``
    for E = 1); dead_fraction = #{i: c_i = 0}/E (002, moe/dead_expert_ratio).
    """

    counts: tuple[int, ...]
    tokens: int
    imbalance: float
    max_violation: float
    entropy: float
    entropy_norm: float | None
    dead_fraction: float


def summarize_expert_counts(counts: torch.Tensor | Sequence[int]) -> ExpertLoad | None:
    """``ExpertLoad`` of per-expert (or per-shard) loads; ``None`` when no valid token arrived."""
    c = [int(v) for v in _host_list(counts)]
    total = sum(c)
    if total == 0:
        return None
    imbalance = max(c) * len(c) / total
    entropy = -sum(v / total * math.log(v / total) for v in c if v > 0)
    entropy_norm = entropy / math.log(len(c)) if len(c) > 1 else None
    dead_fraction = sum(v == 0 for v in c) / len(c)
    return ExpertLoad(
        tuple(c), total, imbalance, imbalance - 1.0, entropy, entropy_norm, dead_fraction
    )


# ---------------------------------------------------------------------- output layer (002)
def logits_stats(
    logits: torch.Tensor, valid: torch.Tensor, *, chunk_elems: int = ROW_CHUNK_ELEMS
) -> torch.Tensor:
    """Output-logit components over valid tokens, float64 [8] in ``LogitsField`` order (002).

    Measurement point: LM-head logits z [..., V] of one micro-batch, ``valid`` [...].
    ELEMENTS = valid tokens · V. SUM_SQ, ABS_MAX cover the finite logits of valid tokens
    (NONFINITE counts the rest, e.g. −inf vocabulary masking), so RMS =
    √(SUM_SQ/(ELEMENTS − NONFINITE)) (logits_rms) and ABS_MAX is logits_abs.max. The gap
    z_(1) − z_(2) (top2_diff) and exact ties z_(1) = z_(2) (top2_equal_ratio) are taken
    over the GAP_TOKENS valid tokens whose two largest logits are finite.
    """
    vocab = logits.shape[-1]
    if vocab < 2:
        raise ValueError("top-2 statistics need a vocabulary of at least 2")
    rows, mask = logits.detach().reshape(-1, vocab), valid.reshape(-1)
    step = max(1, chunk_elems // vocab)
    parts = [_logits_block(rows[i : i + step], mask[i : i + step])
             for i in range(0, rows.shape[0], step)]
    if not parts:
        return torch.zeros(len(LogitsField), dtype=torch.float64, device=logits.device)
    stacked = torch.stack(parts)
    out = stacked.sum(dim=0)
    out[LogitsField.ABS_MAX] = stacked[:, LogitsField.ABS_MAX].amax()
    return out


def _logits_block(block: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    vocab = block.shape[-1]
    scanned = scan(torch.where(keep[:, None], block, 0), chunk_elems=block.numel())
    top = block.topk(2, dim=-1).values.float()
    ok = keep & torch.isfinite(top).all(dim=-1)
    gap = torch.where(ok, top[:, 0] - top[:, 1], 0.0).to(torch.float64).sum()
    ties = (ok & (top[:, 0] == top[:, 1])).sum()
    tokens = keep.sum().to(torch.float64)
    s = ScanFields
    return torch.stack([
        tokens, tokens * vocab, scanned[s.SUM_SQ], scanned[s.ABS_MAX], scanned[s.NONFINITE],
        ok.sum().to(torch.float64), gap, ties.to(torch.float64),
    ])  # fmt: skip


@dataclass(frozen=True, slots=True)
class LogitsSummary:
    """Host-side output-layer statistics (002); ``None`` fields where nothing finite was seen."""

    tokens: int
    rms: float | None
    abs_max: float | None
    nonfinite: int
    top2_gap_mean: float | None
    top2_tie_ratio: float | None


def summarize_logits(vec: torch.Tensor | Sequence[float]) -> LogitsSummary | None:
    """``LogitsSummary`` of a (reduced) ``logits_stats`` vector; ``None`` without valid tokens."""
    v = _host_list(vec)
    tokens = int(v[LogitsField.TOKENS])
    if tokens == 0:
        return None
    nonfinite = int(v[LogitsField.NONFINITE])
    finite = v[LogitsField.ELEMENTS] - nonfinite
    rms = math.sqrt(v[LogitsField.SUM_SQ] / finite) if finite > 0 else None
    abs_max = v[LogitsField.ABS_MAX] if finite > 0 else None
    gaps = v[LogitsField.GAP_TOKENS]
    fields = (LogitsField.GAP_SUM, LogitsField.TIES)
    gap_mean, tie_ratio = (v[f] / gaps if gaps > 0 else None for f in fields)
    return LogitsSummary(tokens, rms, abs_max, nonfinite, gap_mean, tie_ratio)


def mtp_top1_agreement(
    main_logits: torch.Tensor, mtp_logits: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """[positions, agreements] float64 [2] for mtp_{k}_lm_head_top1_agreement (002).

    Rows must be aligned by the caller on the same target token. The main head at position
    t predicts token t+1 and MTP depth k ≥ 1 at position t predicts token t+1+k, so per
    sequence of length S pass ``main[..., k:, :]``, ``mtp_k[..., :S-k, :]`` and the
    validity of those shared targets. Agreement = Σ_valid 1[argmax main = argmax mtp] /
    Σ valid; an argmax tie resolves to the first index in both heads.
    """
    if main_logits.shape != mtp_logits.shape:
        raise ValueError(f"logits differ: {tuple(main_logits.shape)} vs {tuple(mtp_logits.shape)}")
    mask = valid.reshape(-1)
    same = main_logits.detach().argmax(-1).reshape(-1) == mtp_logits.detach().argmax(-1).reshape(-1)
    return torch.stack([mask.sum(), (same & mask).sum()]).to(torch.float64)


def summarize_mtp_agreement(vec: torch.Tensor | Sequence[float]) -> float | None:
    """Top-1 agreement from rank-summed [positions, agreements]; ``None`` without positions."""
    positions, agreements = _host_list(vec)
    return agreements / positions if positions > 0 else None


# -------------------------------------------------------------------------- modality (§9)
def media_scale_components(
    media: torch.Tensor | None, text: torch.Tensor, *,
    media_valid: torch.Tensor | None = None, text_valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σe² and element counts of media and text embeddings, float64 [4], ``MediaField`` order.

    Seeds §9, P0 γ. Measurement point: the backbone's input — ``media`` [..., d] from the
    encoder and projector, ``text`` [..., d] from the token embedding — with optional token
    masks [...] that drop padding and placeholders. Non-finite elements are neither summed
    nor counted. A rank without media passes ``media=None``: its media count is 0, which
    the host reads as "no media measurement". γ is formed by ``media_scale`` only after
    the components are summed over ranks, so each token weighs the same.
    """
    if media is None:
        media_part = torch.zeros(2, dtype=torch.float64, device=text.device)
    else:
        media_part = _masked_square_sum(media, media_valid)
    return torch.cat([media_part, _masked_square_sum(text, text_valid)])


def _masked_square_sum(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    x = x.detach()
    if valid is None:
        elements = torch.full((), float(x.numel()), dtype=torch.float64, device=x.device)
    else:
        x = torch.where(valid.unsqueeze(-1), x, 0)
        elements = valid.sum().to(torch.float64) * x.shape[-1]
    scanned = scan(x)
    return torch.stack([scanned[ScanFields.SUM_SQ], elements - scanned[ScanFields.NONFINITE]])


@dataclass(frozen=True, slots=True)
class MediaScale:
    """Host-side media scale (§9): M2 of each stream and γ = RMS(media)/(RMS(text)+ε)."""

    media_m2: float | None
    text_m2: float | None
    gamma: float | None


def media_scale(vec: torch.Tensor | Sequence[float], *, eps: float = 1e-12) -> MediaScale:
    """``MediaScale`` from rank-summed components; a stream with no elements is ``None``."""
    v = _host_list(vec)
    media_n, text_n = v[MediaField.MEDIA_ELEMENTS], v[MediaField.TEXT_ELEMENTS]
    media_m2 = v[MediaField.MEDIA_SUM_SQ] / media_n if media_n > 0 else None
    text_m2 = v[MediaField.TEXT_SUM_SQ] / text_n if text_n > 0 else None
    gamma = None
    if media_m2 is not None and text_m2 is not None:
        gamma = math.sqrt(media_m2) / (math.sqrt(text_m2) + eps)
    return MediaScale(media_m2, text_m2, gamma)


def modality_token_counts(
    modality_ids: torch.Tensor, valid: torch.Tensor, n_modalities: int
) -> torch.Tensor:
    """Valid target tokens per modality id, int64 [M], for the token share π^(μ) (§3, §9; P0)."""
    return _masked_bincount(modality_ids.reshape(-1, 1), valid.reshape(-1), n_modalities)


def token_shares(counts: torch.Tensor | Sequence[int]) -> tuple[float, ...] | None:
    """π^(μ) = c_μ / Σ c from rank-summed counts; ``None`` when no valid token was seen."""
    c = [int(v) for v in _host_list(counts)]
    total = sum(c)
    return tuple(v / total for v in c) if total > 0 else None


def encoder_grad_share_components(
    encoder_grads: Iterable[torch.Tensor | None], other_grads: Iterable[torch.Tensor | None]
) -> torch.Tensor:
    """[‖g_enc‖², ‖g‖²] float64 [2] for S_enc = ‖g_enc‖²/‖g‖² (§9, P1).

    Measurement point: parameter gradients after accumulation and loss-scale removal,
    before clipping. Pass the encoder's gradients and every other gradient, each once
    (``None`` adds nothing). Squares come from ``scan``, so non-finite elements are left
    out (the gradient-norm probe reports them). Shards add across ranks.
    """
    sums = []
    for grads in (encoder_grads, other_grads):
        parts = [scan(g)[ScanFields.SUM_SQ] for g in grads if g is not None]
        sums.append(torch.stack(parts).sum() if parts else None)
    device = next((s.device for s in sums if s is not None), torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float64, device=device)
    enc, rest = (s if s is not None else zero for s in sums)
    return torch.stack([enc, enc + rest])


def encoder_grad_share(vec: torch.Tensor | Sequence[float]) -> float | None:
    """S_enc from rank-summed [‖g_enc‖², ‖g‖²]; ``None`` when ‖g‖² = 0."""
    enc, total = _host_list(vec)
    return enc / total if total > 0 else None


# -------------------------------------------------------------------------------- helpers
def _masked_bincount(ids: torch.Tensor, valid: torch.Tensor, size: int) -> torch.Tensor:
    """Counts of ``ids`` [T, k] over rows with ``valid`` [T]; fixed output shape [size]."""
    keep = valid.reshape(-1, 1).expand_as(ids)
    safe = torch.where(keep, ids, 0).reshape(-1)
    counts = torch.zeros(size, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, safe, keep.reshape(-1).to(torch.int64))


def _summarize_rows(blocks: torch.Tensor) -> list[TokenSummary] | None:
    rows = [summarize_tokens(row) for row in blocks.detach().to("cpu", torch.float64)]
    return None if any(row is None for row in rows) else rows  # type: ignore[return-value]


def _host_list(vec: torch.Tensor | Sequence[float]) -> list[float]:
    if isinstance(vec, torch.Tensor):
        return vec.detach().to(device="cpu", dtype=torch.float64).reshape(-1).tolist()
    return [float(v) for v in vec]
