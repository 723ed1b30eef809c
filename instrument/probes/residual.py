"""Residual-path probes (seeds 001 §8): per valid token, at each block's residual adds
a = s + b, the branch scale R_b = N_b/(N_s + ε) with N_s and N_b, the block importance
B = 1 − cos(s, a), the angle A and the bfloat16 no-op fraction; and the saturation of
learned branch gates. On scan steps.

Device side: per-token values [T, 6] of every micro-batch are kept on the device (24 bytes
per valid position and branch) and reduced once at the step's end to token blocks (count,
sum, p90, p99, max; "higher" quantiles, bounded across ranks by a maximum). Host side:
residual.* points per (layer, branch); a branch with no valid token sends nothing.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..catalog import Label, Residual, tier_of
from ..discover import GatePoint
from ..parallel import local
from ..state import StepState
from ..wire import Point
from .common import first_tensor, labels_of, recomputing
from .layout import StructureState
from .tokens import TokenField, token_quantiles

__all__ = [
    "ROW_CHUNK_ELEMS",
    "ResidualStat",
    "block_hook",
    "branch_hook",
    "decode_gates",
    "decode_residual",
    "finish_residual",
    "gate_hook",
    "gate_saturation",
    "residual_token_values",
]

TIER = tier_of(
    Residual.TOKENS,
    *(Residual.name(stat, field) for stat in Residual.STATS for field in Residual.FIELDS),
)
GATE_TIER = tier_of(Residual.GATE_CLOSED, Residual.GATE_CHANNELS)
ROW_CHUNK_ELEMS = 1 << 22
"""Elements per row block for [tokens, features] inputs; bounds float32 temporaries."""


class ResidualStat(enum.IntEnum):
    """Columns of ``residual_token_values``, in the order of ``catalog.Residual.STATS``."""

    STREAM_NORM = 0  # N_s = ‖s‖₂
    BRANCH_NORM = 1  # N_b = ‖b‖₂
    BRANCH_RATIO = 2  # R_b = N_b / (N_s + ε)
    BLOCK_IMPORTANCE = 3  # B = 1 − cos(s, a)
    ANGLE = 4  # A = arccos(cos(s, a)) / π
    NOOP_FRAC = 5  # F_noop


assert len(ResidualStat) == len(Residual.STATS)
_FIELDS = (
    ("sum", TokenField.SUM),
    ("p90", TokenField.P90),
    ("p99", TokenField.P99),
    ("max", TokenField.MAX),
)
_NAMES = [
    [(Residual.name(stat, field), column) for field, column in _FIELDS] for stat in Residual.STATS
]


# ------------------------------------------------------------------ device arithmetic
def residual_token_values(
    stream: torch.Tensor,
    branch: torch.Tensor,
    *,
    eps: float = 1e-12,
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


def gate_saturation(
    gate: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    thresholds: Sequence[float],
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


# ------------------------------------------------------------------ host decoding
Parts = list[tuple[np.ndarray, Any]]


def decode_residual(parts: Parts) -> list[Point]:
    out = []
    for values, (layer, branch) in parts:
        block = values.reshape(len(ResidualStat), len(TokenField))
        count = block[0, TokenField.COUNT]
        if not count > 0:
            continue
        lab = labels_of((Label.LAYER, layer), (Label.BRANCH, branch))
        out.append(Point(Residual.TOKENS, float(count), lab))
        for row, names in enumerate(_NAMES):
            out += [Point(name, float(block[row, column]), lab) for name, column in names]
    return out


def decode_gates(parts: Parts) -> list[Point]:
    out = []
    for values, (layer, branch, d, thresholds) in parts:
        lab = ((Label.LAYER, layer), (Label.BRANCH, branch))
        out.append(Point(Residual.GATE_CHANNELS, float(d), labels_of(*lab)))
        out += [
            Point(Residual.GATE_CLOSED, float(round(c)), labels_of(*lab, (Label.THETA, f"{t:g}")))
            for t, c in zip(thresholds, values.tolist())
        ]
    return out


# ------------------------------------------------------------------ hooks
def block_hook(state: StepState, ctx: StructureState, layer: int) -> Callable:
    """Pre-hook of block ``layer``: its input is the attention branch's incoming stream."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not state.due[TIER] or recomputing():
            return None
        s = args[0] if args else kwargs.get("hidden_states")
        if isinstance(s, torch.Tensor) and s.is_floating_point() and s.dim() >= 2:
            ctx.streams[layer] = s.detach()
        return None

    return hook


def branch_hook(
    state: StepState, ctx: StructureState, layer: int, branch: str, *, keep: bool
) -> Callable:
    """Hook of one branch: per-token values against its incoming stream; ``keep`` passes
    s + b on as the next branch's stream (the feed-forward branch after attention)."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not state.due[TIER] or recomputing():
            return None
        s = ctx.streams.pop(layer, None)
        b = first_tensor(output)
        if s is None or b is None or b.shape != s.shape:
            return None
        b = b.detach()
        values = residual_token_values(s, b)
        ctx.residual.setdefault((layer, branch), []).append((values, ctx.valid_flat(s)))
        if keep:
            ctx.streams[layer] = s + b  # the feed-forward branch's incoming stream
        return None

    return hook


def gate_hook(
    state: StepState, ctx: StructureState, gate: GatePoint, thresholds: tuple[float, ...]
) -> Callable:
    """Saturation of one branch gate's channels, once per step."""

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not state.due[GATE_TIER] or recomputing() or id(module) in ctx.once:
            return None
        ctx.once.add(id(module))
        block = gate_saturation(
            local(gate.logits), temperature=gate.temperature, thresholds=thresholds
        )
        d = gate.logits.numel()
        state.collector.add(
            "structure.gates",
            block[:, TokenField.SUM] * d,
            decode_gates,
            (gate.layer, gate.branch, d, thresholds),
        )
        return None

    return hook


def finish_residual(state: StepState, ctx: StructureState) -> None:
    """The step's residual token blocks over all its micro-batches."""
    for (layer, branch), parts in ctx.residual.items():
        values = torch.cat([v for v, _ in parts])
        valid = torch.cat([ok for _, ok in parts])
        block = token_quantiles(values, valid, method="higher")
        state.collector.add("structure.residual", block, decode_residual, (layer, branch))
