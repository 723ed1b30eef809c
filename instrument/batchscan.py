"""Many small tensors scanned together: per tensor, exactly the vector ``scan.scan`` gives.

A P1 step observes a hundred or more tensors; for small ones the cost of ``scan`` is its
dozen kernel launches, not the bytes. Transformers repeat shapes (every layer's q, k, v,
every block's output, every layer's weights), so ``scan_many`` stacks the tensors of one
size into a [k, n] matrix and runs ``scan``'s own sequence of reductions along dim 1:
a dozen kernels per distinct size instead of per tensor. Tensors above ``SMALL_ELEMS``,
and sizes seen once, go through ``scan`` itself.

Where only totals per group are wanted (the gradient's every-step group statistics), not a
row per tensor, ``scan_groups`` copies the small tensors of a group and dtype, whatever
their sizes, into one flat buffer — a ``cat`` of each distinct shape's tensors written into
its slice, so the copy is a few operations however many tensors there are (a P0 step's
operations do not grow with the model's tensors; issue 35) — and scans the buffer in blocks
of up to one ``scan`` chunk: a dozen kernels per block. It runs in two halves
(``gather_groups``, then ``GroupScan.rows``): the buffers are copies, so the reductions may
run later and on another thread (the gradient probe, on CPU). Which tensor goes whole and
which into which buffer and slice is planned once per list of sizes (``plan_groups``): a
model's gradients keep theirs from step to step.

Fields, dtypes and conventions are ``scan``'s (``ScanFields``): float32 work (float64 for
float64 inputs or with moments), sums over finite elements, NONFINITE counts the others,
ABS_MAX over finite elements.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .scan import (
    BASE_FIELDS,
    CPU_CHUNK_ELEMS,
    DEVICE_CHUNK_ELEMS,
    MOMENT_FIELDS,
    fused_scan,
    row_fields,
    scan,
)

__all__ = [
    "SMALL_ELEMS",
    "Gather",
    "GroupPlan",
    "GroupScan",
    "gather_groups",
    "plan_groups",
    "scan_groups",
    "scan_many",
]

SMALL_ELEMS = 1 << 16
"""Tensors up to this many elements are batched with others of their size."""
STACK_ELEMS = 1 << 22
"""Elements per stacked matrix: bounds the working copy at 16 MiB in float32."""

F64 = torch.float64


def _work_dtype(tensors: Sequence[torch.Tensor], moments: bool) -> torch.dtype:
    return F64 if moments or any(t.dtype == F64 for t in tensors) else torch.float32


def _rows(tensors: Sequence[torch.Tensor], moments: bool) -> torch.Tensor:
    """[k, fields] of k same-sized tensors: ``scan``'s chunk arithmetic along dim 1."""
    work = torch.stack([t.detach().reshape(-1) for t in tensors])  # a fresh copy
    return row_fields(work.to(_work_dtype(tensors, moments)), moments)


@dataclass(slots=True)
class GroupScan:
    """``scan_groups`` in two halves: ``gather_groups`` scanned the large tensors and copied
    the small ones, a flat buffer per gather; ``rows`` reduces the buffers' blocks. The
    buffers are fresh copies, so ``rows`` may run later, on another thread, after the
    tensors changed (a clip)."""

    rows_done: list[torch.Tensor]  # [1, fields] rows of the tensors scanned whole
    copies: list[torch.Tensor]  # [n] one flat copy per ``Gather``, still to reduce
    bounds: list[tuple[tuple[int, int], ...]]  # each copy's blocks: (start, stop), one row each
    row_groups: list[int]  # the group of each row: rows_done's, then the blocks'
    moments: bool
    fused: bool
    device: torch.device | None

    @property
    def on_host(self) -> bool:
        """Every row on the CPU and the eager reductions (``rows`` may run on any thread)."""
        return not (self.fused and not self.moments) and all(
            t.device.type == "cpu" for t in (*self.rows_done, *self.copies)
        )

    def rows(self) -> torch.Tensor:
        """``[R, fields]`` float64 rows, in the order of ``row_groups``."""
        one_pass = self.fused and not self.moments
        blocks = [
            copy[start:stop]  # disjoint views: each block's reductions overwrite only it
            for copy, bounds in zip(self.copies, self.bounds)
            for start, stop in bounds
        ]
        rows = self.rows_done + [
            fused_scan(work).unsqueeze(0)
            if one_pass
            else row_fields(work.unsqueeze(0), self.moments)
            for work in blocks
        ]
        if not rows:
            width = MOMENT_FIELDS if self.moments else BASE_FIELDS
            return torch.zeros(0, width, dtype=F64, device=self.device)
        return torch.cat(rows)


@dataclass(frozen=True, slots=True)
class Gather:
    """Small tensors of one group, device and dtype, copied into one flat buffer and reduced
    in blocks of it. The copy is one ``cat`` per distinct shape, written in place into the
    buffer (``cat`` of same-shaped tensors into a slice of their dtype is one operation, on
    a device one kernel, with no per-tensor view): a model's repeated layers give a few
    shapes, however many tensors."""

    parts: tuple[tuple[tuple[int, ...], int, tuple[int, ...]], ...]
    """per shape: (indices into the list, start in the buffer, the slice's shape)"""
    scalars: tuple[int, ...]  # indices of 0-d tensors (``cat`` needs a dimension), at the end
    elems: int  # their elements together
    bounds: tuple[tuple[int, int], ...]  # the blocks: (start, stop) in the buffer
    dtype: torch.dtype  # the members' dtype


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """Which of a list's tensors are scanned whole and which are copied into which block.

    It depends only on each tensor's size, dtype, device and group, so a list whose tensors
    keep those (a model's gradients, step after step) is planned once (``plan_groups``)
    and gathered every step (``gather_groups``): the per-tensor Python runs once, and the
    copies are one operation per (group, device, dtype), however many tensors."""

    whole: tuple[int, ...]  # indices scanned on their own
    gathers: tuple[Gather, ...]  # the small tensors, one flat copy per (group, device, dtype)
    row_groups: tuple[int, ...]  # the group of each row: whole's, then each gather's blocks'


def plan_groups(
    tensors: Sequence[torch.Tensor], groups: Sequence[int], chunk_elems: int | None = None
) -> GroupPlan:
    """``groups[i]`` is ``tensors[i]``'s group. The small floating tensors of one group,
    device and dtype are copied together and reduced in blocks of at most ``chunk_elems``
    elements (``scan``'s chunk by default), in list order; other non-empty tensors are
    scanned whole."""
    whole: list[int] = []
    small: dict[tuple, list[tuple[int, int]]] = {}
    for i, (t, group) in enumerate(zip(tensors, groups)):
        n = t.numel()
        if 0 < n <= SMALL_ELEMS and t.is_floating_point() and not t.is_complex():
            small.setdefault((group, t.device, t.dtype), []).append((i, n))
        elif n:
            whole.append(i)
    gathers: list[Gather] = []
    row_groups = [groups[i] for i in whole]
    for (group, device, dtype), members in small.items():
        # a block as large as one of scan's chunks, whose work buffer stays in cache while
        # the reductions re-read it (850k elements, caches flushed, one CPU core: 2.2-2.4 ms
        # in 256k-element blocks, 2.3-3.0 ms as one block)
        limit = min(
            STACK_ELEMS,
            chunk_elems or (CPU_CHUNK_ELEMS if device.type == "cpu" else DEVICE_CHUNK_ELEMS),
        )
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, _ in members:
            by_shape.setdefault(tuple(tensors[i].shape), []).append(i)
        scalars = tuple(by_shape.pop((), ()))
        parts, start = [], 0
        for shape, indices in by_shape.items():
            parts.append((tuple(indices), start, (len(indices) * shape[0], *shape[1:])))
            start += len(indices) * math.prod(shape)
        sizes = [tensors[i].numel() for indices in by_shape.values() for i in indices]
        bounds = tuple(_blocks(sizes + [1] * len(scalars), limit))  # the buffer's order
        gathers.append(Gather(tuple(parts), scalars, start + len(scalars), bounds, dtype))
        row_groups += [group] * len(bounds)
    return GroupPlan(tuple(whole), tuple(gathers), tuple(row_groups))


def gather_groups(
    tensors: Sequence[torch.Tensor],
    plan: GroupPlan,
    *,
    moments: bool = False,
    chunk_elems: int | None = None,
    fused: bool = False,
) -> GroupScan:
    """The first half of ``scan_groups``, by ``plan`` (of these tensors' sizes, dtypes,
    devices and groups): the whole tensors scanned now, the small ones copied."""
    one_pass = fused and not moments
    rows = [
        (
            fused_scan(tensors[i])
            if one_pass
            else scan(tensors[i], moments=moments, chunk_elems=chunk_elems)
        ).unsqueeze(0)
        for i in plan.whole
    ]
    copies = [_flat_copy(tensors, gather, moments) for gather in plan.gathers]
    device = tensors[0].device if tensors else None
    bounds = [gather.bounds for gather in plan.gathers]
    return GroupScan(rows, copies, bounds, list(plan.row_groups), moments, fused, device)


def _blocks(sizes: list[int], limit: int) -> Iterator[tuple[int, int]]:
    """Consecutive members of ``sizes`` elements in blocks of at most ``limit`` elements (a
    larger one alone), as (start, stop) element offsets."""
    start = stop = 0
    for n in sizes:
        if stop > start and stop - start + n > limit:
            yield start, stop
            start = stop
        stop += n
    if stop > start:
        yield start, stop


def _flat_copy(tensors: Sequence[torch.Tensor], gather: Gather, moments: bool) -> torch.Tensor:
    """A fresh 1-D copy of ``gather``'s members in the work dtype, which the reductions
    overwrite: one buffer, a ``cat`` per shape written into its slice of it."""
    pick = tensors.__getitem__
    first = tensors[gather.parts[0][0][0] if gather.parts else gather.scalars[0]]
    flat = torch.empty(gather.elems, dtype=gather.dtype, device=first.device)
    with torch.no_grad():  # out= records no graph (a create_graph gradient)
        for indices, start, shape in gather.parts:
            stop = start + math.prod(shape)
            torch.cat(list(map(pick, indices)), out=flat[start:stop].view(shape))
        if gather.scalars:
            torch.stack(list(map(pick, gather.scalars)), out=flat[-len(gather.scalars) :])
    dtype = F64 if moments or gather.dtype == F64 else torch.float32
    return flat if flat.dtype == dtype else flat.to(dtype)


def scan_groups(
    tensors: Sequence[torch.Tensor],
    groups: Sequence[int],
    *,
    moments: bool = False,
    chunk_elems: int | None = None,
    fused: bool = False,
) -> tuple[torch.Tensor, list[int]]:
    """Scan rows whose combination per group is that of ``scan_many``'s rows per group.

    ``groups[i]`` is ``tensors[i]``'s group. Returns ``[R, fields]`` float64 rows and each
    row's group. The small floating tensors of one group (and device) are concatenated in
    blocks of at most ``chunk_elems`` elements (``scan``'s default chunk), each block one
    row; other tensors get their own ``scan``. Empty tensors give no row (their all-zero
    row combines to nothing).
    ``fused`` (without moments): each large tensor and block through the compiled one-pass
    ``fused_scan`` instead of the eager reductions.
    """
    gathered = gather_groups(
        tensors,
        plan_groups(tensors, groups, chunk_elems),
        moments=moments,
        chunk_elems=chunk_elems,
        fused=fused,
    )
    return gathered.rows(), gathered.row_groups


def scan_many(
    tensors: Sequence[torch.Tensor], *, moments: bool = False, chunk_elems: int | None = None
) -> torch.Tensor:
    """``[K, fields]`` float64 on the tensors' device: row i is ``scan(tensors[i])``.

    An empty tensor gives an all-zero row, as ``scan`` does.
    """
    width = MOMENT_FIELDS if moments else BASE_FIELDS
    if not tensors:
        return torch.zeros(0, width, dtype=F64)
    rows: list[torch.Tensor | None] = [None] * len(tensors)
    by_size: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        n = t.numel()
        if 0 < n <= SMALL_ELEMS and t.is_floating_point() and not t.is_complex():
            by_size.setdefault((n, t.device), []).append(i)
        else:
            rows[i] = scan(t, moments=moments, chunk_elems=chunk_elems)
    for (n, _), members in by_size.items():
        if len(members) == 1:
            rows[members[0]] = scan(tensors[members[0]], moments=moments, chunk_elems=chunk_elems)
            continue
        per_block = max(1, STACK_ELEMS // n)
        for start in range(0, len(members), per_block):
            block = members[start : start + per_block]
            for i, row in zip(block, _rows([tensors[i] for i in block], moments)):
                rows[i] = row
    return torch.stack(rows)  # type: ignore[arg-type]
