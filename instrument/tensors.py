"""Tensor probes of one step: what is scanned, when, and how the rows reach the collector.

Every observation of a P1 step becomes an ``Entry``: a tensor the step owns (a copy or a
fresh result, so later in-place changes — clipping, the optimizer, an in-place activation,
``zero_grad`` — cannot reach it), its name and kind. At the end of the step all entries
are scanned together with ``batchscan.scan_many``, which batches tensors of equal size
across kinds and layers. Activations larger than ``SMALL_ELEMS`` are scanned at once
instead of copied. Activations are masked to valid positions: padded positions become
exact zeros in the copy, and their rows get N = valid positions × features and the zeros
of the padding removed. Gradients that still carry a loss scale are unscaled in the copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .batchscan import SMALL_ELEMS, scan_many
from .probes import host_values, masked_scan, scale_scan, split_parts
from .registry import GRAD_GROUPS
from .scan import ScanFields

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["Entry", "group_rows", "observe", "parameter_entries", "scan_deferred", "scan_entries"]

F64 = torch.float64


@dataclass(slots=True)
class Entry:
    """One tensor to scan: ``correction`` = (valid count, mask elements) for pre-masked
    activations; ``emit`` False for a gradient scanned only for this rank's group sums."""

    name: str
    kind: str
    tensor: torch.Tensor
    correction: tuple[torch.Tensor, int] | None = None
    emit: bool = True
    group: int | None = None      # gradient group, for this rank's grad.* detail rows


def _parts(names: tuple[str, ...], x: torch.Tensor, dim: int) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the whole, or of each fused part along ``dim``."""
    pieces = split_parts(x, len(names) - 1, dim) if len(names) > 2 else None
    return list(zip(names[1:], pieces)) if pieces is not None else [(names[0], x)]


def observe(monitor: "Monitor", names: tuple[str, ...], kind: str, x: torch.Tensor,
            mask: torch.Tensor | None) -> None:
    """An activation (fwd) or its gradient (bwd): deferred when small, else scanned now."""
    x = x.detach()
    fits = (mask is not None and x.dim() >= mask.dim()
            and tuple(x.shape[:mask.dim()]) == tuple(mask.shape) and x.numel() > 0)
    if fits:
        shaped = mask.reshape(*mask.shape, *([1] * (x.dim() - mask.dim())))
    for name, part in _parts(names, x, -1):
        if part.numel() > SMALL_ELEMS:
            vec = masked_scan(part, mask if fits else None, monitor._mask_count(mask) if fits
                              else None, moments=monitor._p2_on, chunk_elems=monitor._chunk)
            monitor._collector.add_scan(name, kind, vec)
        elif fits:
            monitor._deferred.append(Entry(name, kind, torch.where(shaped, part, 0),
                                           (monitor._mask_count(mask), mask.numel())))
        else:
            monitor._deferred.append(Entry(name, kind, part.clone()))


def scan_entries(monitor: "Monitor", entries: Sequence[Entry], inv_scale: Any = None
                 ) -> torch.Tensor | None:
    """Scan ``entries`` together; add the emitted rows to the step; return all rows."""
    if not entries:
        return None
    rows = scan_many([e.tensor for e in entries], moments=monitor._p2_on,
                     chunk_elems=monitor._chunk)
    corrected = [(i, e.correction) for i, e in enumerate(entries) if e.correction is not None]
    if corrected:
        index = host_values([i for i, _ in corrected], rows.device)
        counts = torch.stack([c for _, (c, _) in corrected]).to(device=rows.device, dtype=F64)
        features = host_values([entries[i].tensor.numel() / m for i, (_, m) in corrected],
                               rows.device, F64)
        padded = host_values([float(m) for _, (_, m) in corrected], rows.device, F64) - counts
        rows[index, ScanFields.N] = counts * features
        rows[index, ScanFields.ZEROS] -= padded * features
    if inv_scale is not None:
        rows = scale_scan(rows, inv_scale)
    emitted = [i for i, e in enumerate(entries) if e.emit]
    if emitted:
        keys = [(entries[i].name, entries[i].kind) for i in emitted]
        monitor._collector.add_scan_rows(
            keys, rows if len(emitted) == len(entries) else rows[host_values(emitted, rows.device)])
    return rows


def scan_deferred(monitor: "Monitor") -> None:
    """End of a P1 step: scan every entry of the step in one batch; gradient entries also
    feed this rank's grad.* detail rows (all, embedding, expert, other)."""
    entries, monitor._deferred = monitor._deferred, []
    rows = scan_entries(monitor, entries)
    grads = [(i, e.group) for i, e in enumerate(entries) if e.group is not None]
    if rows is not None and grads:
        index = host_values([i for i, _ in grads], rows.device)
        groups = [g for _, g in grads]
        monitor._grad_scans = (group_rows(rows[index], groups), tuple(sorted(set(groups))))


def parameter_entries(names: dict[int, tuple[str, ...]], kind: str,
                      tensors: Sequence[tuple[torch.Tensor, torch.Tensor]], emit: bool = True,
                      group: int | None = None) -> list[Entry]:
    """Entries of parameter-side tensors ``(param, tensor)``, fused parts along dim 0."""
    out = []
    for param, tensor in tensors:
        for name, part in _parts(names[id(param)], tensor.detach(), 0):
            out.append(Entry(name, kind, part, None, emit, group))
    return out


def group_rows(rows: torch.Tensor, groups: Sequence[int]) -> torch.Tensor:
    """[all, embedding, expert, other] combined gradient scan rows, flattened."""
    index = host_values(groups, rows.device)
    out = torch.zeros(len(GRAD_GROUPS), rows.shape[1], dtype=F64, device=rows.device)
    out.index_add_(0, index, rows)
    maxima = torch.zeros(len(GRAD_GROUPS), dtype=F64, device=rows.device)
    out[:, ScanFields.ABS_MAX] = maxima.scatter_reduce_(0, index, rows[:, ScanFields.ABS_MAX],
                                                        "amax", include_self=True)
    total = out.sum(dim=0, keepdim=True)
    total[0, ScanFields.ABS_MAX] = out[:, ScanFields.ABS_MAX].amax()
    return torch.cat([total, out]).reshape(-1)
