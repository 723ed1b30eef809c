"""The loss probe (seeds 001 §3): per-token NLL sums and valid-token counts, by source.

Device side (``loss_components``): per-row sums and valid counts of one micro-batch in
float64, row ids as they are (grouped on the host) or token ids reduced on the device.
Host side (``loss_decoder``): loss.sum / loss.tokens, unlabelled and per registered source
or modality with tokens > 0. A rank with no valid token sends no loss point, never a zero;
the stream forms L = Σ loss.sum / Σ loss.tokens, L_max and L^(μ) from them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..catalog import Label, Loss, tier_of
from ..collect import to_device
from ..state import StepState
from ..wire import Labels, Point
from .common import F64

__all__ = ["KEY", "LossProbe", "loss_components", "loss_decoder"]

TIER = tier_of(Loss.SUM, Loss.TOKENS)
KEY = "loss"  # the step collector's key of the loss parts (a replay reads them too)


def _expand_ids(ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Token ids broadcast to ``like``'s shape."""
    while ids.dim() < like.dim():
        ids = ids.unsqueeze(-1)
    return ids.expand_as(like)


def loss_components(
    losses: torch.Tensor,
    mask: torch.Tensor | None,
    ids: Sequence[tuple[torch.Tensor | None, int]],
    n_labels: int,
) -> tuple[list[torch.Tensor], tuple]:
    """Per-row loss sums and valid counts of one micro-batch, float64 (seeds 001 §3).

    ``losses`` are per-token NLL values [B, ...] (a 1-D tensor is one row), ``mask`` the
    valid-target mask of the same shape (None: all valid). ``ids`` pairs an id tensor with
    the label offset of its registry (sources first, then modalities): row ids [B] are
    sent as they are and grouped on the host; token ids (the losses' shape) are reduced
    on the device. Masked positions are replaced by 0 first, so a NaN at a padded position
    cannot leak in. Returns the tensors (three kernels for row ids) and their layout (rows,
    row-id offsets, token-level, labels) for ``loss_decoder``::

        [row sums (B), row counts (B), row ids (B) per row-id set, label sums (G),
         label counts (G) when token ids were given]
    """
    losses = losses.detach()
    rows = losses.shape[0] if losses.dim() >= 2 else 1
    values = losses if mask is None else torch.where(mask, losses, 0)
    flat2d = losses.dim() == 2  # [B, T]: row sums without a reshape
    parts = [(values if flat2d else values.reshape(rows, -1)).sum(-1, dtype=F64)]
    if mask is None:
        parts.append(
            torch.full((rows,), float(losses.numel() // rows), dtype=F64, device=losses.device)
        )
    else:  # an integer count: the step's cat promotes it to float64 exactly
        parts.append((mask if flat2d else mask.reshape(rows, -1)).sum(-1))
    row_offsets: list[int] = []
    token_ids: list[tuple[torch.Tensor, int]] = []
    for id_tensor, offset in ids:
        if id_tensor is None or not n_labels:
            continue
        if id_tensor.dim() == 1 and id_tensor.shape[0] == rows and losses.dim() >= 2:
            parts.append(to_device(id_tensor, losses.device))
            row_offsets.append(offset)
        else:
            token_ids.append((id_tensor, offset))
    if token_ids:
        flat_values = values.reshape(-1).to(F64)
        flat_mask = mask.reshape(-1).to(F64) if mask is not None else torch.ones_like(flat_values)
        sums = torch.zeros(n_labels, dtype=F64, device=losses.device)
        counts = torch.zeros(n_labels, dtype=F64, device=losses.device)
        for id_tensor, offset in token_ids:
            index = _expand_ids(to_device(id_tensor, losses.device), losses).reshape(-1)
            if mask is not None:
                index = torch.where(mask.reshape(-1), index, 0)
            if offset:
                index = index + offset
            sums.index_add_(0, index, flat_values)
            counts.index_add_(0, index, flat_mask)
        parts += [sums, counts]
    return parts, (rows, tuple(row_offsets), bool(token_ids), n_labels)


def loss_decoder(label_points: Sequence[Labels]):
    """loss.sum / loss.tokens, unlabelled and per source or modality with tokens > 0.
    Each part is one ``loss_components`` call (or a fused loss's [sum, count])."""
    n_labels = len(label_points)

    def decode(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
        totals: list[float] = []
        counts_all: list[float] = []
        sums = [0.0] * n_labels
        counts = [0.0] * n_labels
        for array, (rows, row_offsets, token_level, _) in parts:
            values = array.tolist()
            row_sums, row_counts = values[:rows], values[rows : 2 * rows]
            totals += row_sums
            counts_all += row_counts
            for j, offset in enumerate(row_offsets):
                ids = values[(2 + j) * rows : (3 + j) * rows]
                for label, s, n in zip(ids, row_sums, row_counts):
                    sums[int(label) + offset] += s
                    counts[int(label) + offset] += n
            if token_level:
                for i in range(n_labels):
                    sums[i] += values[-2 * n_labels + i]
                    counts[i] += values[-n_labels + i]
        count = math.fsum(counts_all)
        if not count > 0:
            return []  # no valid token on this rank: no measurement, never a zero
        out = [Point(Loss.SUM, math.fsum(totals)), Point(Loss.TOKENS, count)]
        for i, labels in enumerate(label_points):
            if counts[i] > 0:
                out += [Point(Loss.SUM, sums[i], labels), Point(Loss.TOKENS, counts[i], labels)]
        return out

    return decode


def _ids(value: Any, names: tuple[str, ...], rows: int, what: str) -> torch.Tensor | None:
    """Ids as given (a tensor), or from registered names: one name for every row of the
    micro-batch, or one name per row. An unknown name is the caller's mistake."""
    if value is None or isinstance(value, torch.Tensor):
        return value
    listed = [value] * rows if isinstance(value, str) else list(value)
    try:
        ids = [names.index(name) for name in listed]
    except ValueError:
        unknown = next(n for n in listed if n not in names)
        field = "sources" if what == "source" else "modalities"
        raise ValueError(
            f"{what} {unknown!r} is not registered; ProbeConfig.{field} is {names!r}"
        ) from None
    if len(ids) != rows:
        raise ValueError(f"{len(ids)} {what} names for a micro-batch of {rows} rows")
    return torch.tensor(ids, dtype=torch.int64)


class LossProbe:
    """Records one micro-batch's loss components into the step (sources, then modalities,
    share the label namespace ``source``)."""

    def __init__(self, sources: Sequence[str], modalities: Sequence[str]) -> None:
        self._sources, self._modalities = tuple(sources), tuple(modalities)
        self._n_sources = len(sources)
        self._n_labels = len(sources) + len(modalities)
        self._decode = loss_decoder(
            tuple(((Label.SOURCE, name),) for name in (*sources, *modalities))
        )

    def record(
        self,
        state: StepState,
        losses: torch.Tensor,
        mask: torch.Tensor | None,
        source: torch.Tensor | None,
        modality: torch.Tensor | None,
    ) -> None:
        if not state.due[TIER]:
            return
        mask = state.mask if mask is None else mask
        source = state.source if source is None else source
        modality = state.modality if modality is None else modality
        rows = losses.shape[0] if losses.dim() >= 2 else 1
        ids = (
            (_ids(source, self._sources, rows, "source"), 0),
            (_ids(modality, self._modalities, rows, "modality"), self._n_sources),
        )
        vec, meta = loss_components(losses, mask, ids, self._n_labels)
        state.collector.add(KEY, vec, self._decode, meta)

    def record_totals(self, state: StepState, loss_sum: Any, valid_tokens: Any) -> None:
        """A fused loss's Σ m·ℓ and Σ m for one micro-batch."""
        if not state.due[TIER]:
            return
        device = next(
            (v.device for v in (loss_sum, valid_tokens) if isinstance(v, torch.Tensor)),
            torch.device("cpu"),
        )
        parts = [
            v.detach().reshape(1)
            if isinstance(v, torch.Tensor)  # no copy: a fill kernel
            else torch.full((1,), float(v), dtype=F64, device=device)
            for v in (loss_sum, valid_tokens)
        ]
        state.collector.add(KEY, parts, self._decode, (1, (), False, self._n_labels))
