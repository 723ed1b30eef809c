"""The output-layer probe (002 output layer, 001 §6): logits max |z|, Σ z² and positions on
every step, the top-2 gap and ties on scan steps, over valid positions.

Device side: per position max z, min z and ‖z‖ over the vocabulary (three row reductions,
or one compiled pass over the logits with ``scan_backend="compiled"``, the default on a
GPU); a small micro-batch ships those rows as they are, a large one reduces them on the
device to four values. Host side: max |z| over positions (NaN propagates on purpose: an overflow
at the output must show as a non-finite measurement), Σ z², positions × vocabulary. The
hook sits on the logits module; a recomputation (activation checkpointing) measures
nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..catalog import Output, tier_of
from ..scan import compiled
from ..state import StepState
from ..wire import Point
from .common import F64, first_tensor, recomputing

__all__ = [
    "HOST_REDUCE_POSITIONS",
    "decode_head",
    "decode_top2",
    "logits_hook",
    "output_head",
    "output_top2",
]

STATS_TIER = tier_of(Output.LOGITS_ABS_MAX, Output.LOGITS_SUM_SQ, Output.LOGITS_N)
TOP2_TIER = tier_of(Output.POSITIONS, Output.TOP2_GAP_SUM, Output.TOP2_EQUAL)

HOST_REDUCE_POSITIONS = 8192
"""Up to this many positions per micro-batch, ``output_head`` ships its per-position rows
and the host reduces them (fewer kernels); above it the device reduces them to 4 values."""


def _row_stats(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of z [P, V]: max z, min z and ‖z‖ (float32 at least), in one expression for
    ``torch.compile`` to fuse into one read of the logits."""
    work = z.to(torch.promote_types(z.dtype, torch.float32))
    return work.amax(-1), work.amin(-1), (work * work).sum(-1).sqrt()


def output_head(
    logits: torch.Tensor, mask: torch.Tensor | None, fused: bool = False
) -> tuple[list[torch.Tensor], tuple]:
    """Output-logit components over valid positions of logits z [..., V] (002, 001 §6).

    Per position: max z, min z and ‖z‖ over the vocabulary: three reads of the logits, or
    with ``fused`` one compiled pass (``scan_backend="compiled"``: 2048 × 32,000 float32
    logits on a CPU core 27 → 17 ms; at 256 × 512, 34 → 47 us; on a GPU the three reads
    are memory-bound). For a small micro-batch the rows and the mask are returned as they
    are (meta "rows"); for a large one they are masked and reduced on the device to
    [max z, max −z, ‖z‖, positions] (meta "reduced").
    """
    vocab = logits.shape[-1]
    masked = mask is not None and tuple(logits.shape[:-1]) == tuple(mask.shape)
    z = logits.detach().reshape(-1, vocab)  # positions × vocabulary: 1-D row statistics
    positions = z.shape[0]
    if fused:
        top, bottom, norms = compiled(_row_stats)(z)
    else:
        top, bottom = z.amax(-1), z.amin(-1)
        norms = torch.linalg.vector_norm(
            z, dim=-1, dtype=torch.promote_types(z.dtype, torch.float32)
        )
    if positions <= HOST_REDUCE_POSITIONS:
        rows = [top, bottom, norms, mask.reshape(-1)] if masked else [top, bottom, norms]
        return rows, ("rows", positions, masked, vocab)
    mask = mask.reshape(-1) if masked else None
    stacked = torch.stack([top, bottom.neg_(), norms])
    if masked:
        stacked = torch.where(mask, stacked, 0)
        count = mask.sum(dtype=F64).reshape(1)
    else:
        count = torch.full((1,), float(positions), dtype=F64, device=z.device)
    return (
        [stacked[:2].amax(dim=1), torch.linalg.vector_norm(stacked[2], dim=0, keepdim=True), count],
        ("reduced", positions, masked, vocab),
    )


def decode_head(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    """Per micro-batch either the rows [max z (P), min z (P), ‖z‖ (P), mask (P)?] or the
    device-reduced [max z, max −z, ‖z‖, positions]; meta (form, P, masked, vocab)."""
    maxima: list[float] = []
    sum_sq = positions = 0.0
    vocab = 1
    for values, (form, n, masked, part_vocab) in parts:
        vocab = part_vocab  # the same in every part
        if form == "rows":
            rows = values[: 3 * n].reshape(3, n)
            if masked:
                rows = rows[:, values[3 * n : 4 * n] != 0]
            count = rows.shape[1]
            if count:  # NumPy's max/min propagate NaN, as the definition wants
                maxima += [float(rows[0].max()), -float(rows[1].min())]
                sum_sq += float(np.dot(rows[2], rows[2]))
        else:
            count = float(values[3])
            if count:
                maxima += [float(values[0]), float(values[1])]
            sum_sq += float(values[2]) ** 2
        positions += count
    if not positions > 0:
        return []  # no valid position reached the head: no measurement
    abs_max = math.nan if any(math.isnan(m) for m in maxima) else max(maxima)
    return [
        Point(Output.LOGITS_ABS_MAX, abs_max),
        Point(Output.LOGITS_SUM_SQ, sum_sq),
        Point(Output.LOGITS_N, positions * vocab),
    ]


def output_top2(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``[positions, Σ (z_(1) − z_(2)), Σ 1[z_(1) = z_(2)]]`` over valid positions (002)."""
    z = logits.detach()
    top = z.topk(2, dim=-1).values.to(torch.float32)
    gap = top[..., 0] - top[..., 1]
    if mask is not None and tuple(gap.shape) == tuple(mask.shape):
        valid = mask
        gap = torch.where(mask, gap, 0)
        positions = mask.sum(dtype=F64)
    else:
        valid = torch.ones_like(gap, dtype=torch.bool)
        positions = torch.full((), float(gap.numel()), dtype=F64, device=z.device)
    ties = (valid & (top[..., 0] == top[..., 1])).sum(dtype=F64)
    return torch.stack([positions, gap.to(F64).sum(), ties])


def decode_top2(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    total = [0.0, 0.0, 0.0]
    for values, _ in parts:
        total = [a + b for a, b in zip(total, values.tolist())]
    if not total[0] > 0:
        return []
    return [
        Point(Output.POSITIONS, total[0]),
        Point(Output.TOP2_GAP_SUM, total[1]),
        Point(Output.TOP2_EQUAL, total[2]),
    ]


def logits_hook(state: StepState, fused: bool = False) -> Callable:
    """The forward hook of the logits module: head statistics (``output_head``, ``fused``
    or not), and top-2 on scan steps."""

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if not state.due[STATS_TIER] or recomputing():
            return None
        z = first_tensor(output)
        if z is None or z.dim() == 0 or z.shape[-1] < 2:
            return None
        mask = state.mask
        vec, meta = output_head(z, mask, fused)
        state.collector.add("output.head", vec, decode_head, meta)
        if state.due[TOP2_TIER]:
            state.collector.add("output.top2", output_top2(z, mask), decode_top2)
        return None

    return hook
