"""The rank's per-step state: one leaf object that hooks and probes receive.

``StepState`` holds what one optimizer step has seen so far — which tiers are due, the
inputs the loop described (``micro_batch``), the device parts waiting for the step's one
transfer, the tensors waiting for the step's batched scan, the gradient measurements —
and is reset when the step closes. It also carries the few counters that span steps
(guard events since the last emitted step, timing of the last step). ``Schedule`` decides
which tiers are due at a step: each tier's interval (``ProbeConfig.cadence``), the steps a
control message densified, and the steps whose scan tier is measured for the ring buffer
only (``ProbeConfig.ring_every``: ``held``).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .catalog import Tier
from .collect import StepCollector

__all__ = ["Entry", "Schedule", "StepState"]

F64 = torch.float64


class Schedule:
    """Which tiers are due at step t: ``every[tier] > 0 and t % every[tier] == 0``, and the
    step and scan tiers on every step while densified. Forensics (the demand tier) are never
    densified: on the demo MoE, densified forensics raised the rank's peak RSS by ~115 MiB
    and paged peak_memory on the monitor's own allocations."""

    def __init__(self, every: Mapping[Tier, int], ring_every: int = 0) -> None:
        self._every = tuple(int(every[tier]) for tier in Tier)
        self._ring_every = int(ring_every)
        self._dense_until = -1
        self._commands: queue.SimpleQueue[int] = queue.SimpleQueue()

    def densify(self, steps: int) -> None:
        """Run the step and scan tiers on every step for the next ``steps`` steps (any thread)."""
        self._commands.put(int(steps))

    def due(self, step: int) -> dict[Tier, bool]:
        while not self._commands.empty():
            self._dense_until = step + self._commands.get_nowait()
        dense = step < self._dense_until
        on = {tier: every > 0 and step % every == 0 for tier, every in zip(Tier, self._every)}
        on[Tier.STEP] |= dense
        on[Tier.SCAN] |= dense
        return on

    def held(self, step: int, due: Mapping[Tier, bool]) -> bool:
        """Whether step ``step`` measures the scan tier for the ring only (``ring_every``):
        the scan tier is not due to be sent, and the ring's interval says measure."""
        every = self._ring_every
        return every > 0 and not due[Tier.SCAN] and step % every == 0


_NOTHING_DUE = {tier: False for tier in Tier}


@dataclass(slots=True)
class Entry:
    """One tensor to scan at the step's end: ``correction`` = (valid count, mask elements)
    for pre-masked activations; ``emit`` False for a gradient scanned only for this rank's
    group sums; ``group`` its gradient group (``catalog.GRAD_GROUPS`` index)."""

    name: str
    kind: str
    tensor: torch.Tensor
    correction: tuple[torch.Tensor, int] | None = None
    emit: bool = True
    group: int | None = None


class StepState:
    """What the current step has seen; every hook's first line reads ``due``."""

    __slots__ = (
        "step",
        "due",
        "held",
        "t0",
        "collector",
        "mask",
        "source",
        "modality",
        "positions",
        "_mask_count",
        "entries",
        "scan_rows",
        "g2",
        "grad_rows",
        "clip",
        "max_norm",
        "scaler",
        "pending_bwd",
        "comm_waits",
        "guard",
        "last_step_time_s",
        "emit_time_s",
        "emitted_steps",
    )

    def __init__(self) -> None:
        self.collector = StepCollector()
        self.guard = [0, 0, 0]  # skipped, replayed, replay mismatch since the last emit
        self.last_step_time_s = 0.0  # the step time of the last closed step
        self.emit_time_s = 0.0  # training-thread time spent sealing + enqueueing
        self.emitted_steps = 0
        self.reset()

    def open(self, step: int, due: dict[Tier, bool], t0: float, held: bool = False) -> None:
        self.step, self.due, self.t0, self.held = step, due, t0, held

    @property
    def sampled(self) -> bool:
        """Whether any tier is due (the step emits a record)."""
        return any(self.due.values())

    def reset(self) -> None:
        """Back to "no step open": every hook then returns at its first line."""
        self.step: int | None = None
        self.due: dict[Tier, bool] = _NOTHING_DUE
        self.held = False  # the scan tier runs for the ring only (not sent unless dumped)
        self.t0 = 0.0
        # what the loop described with micro_batch (references: read on the emitter thread)
        self.mask: torch.Tensor | None = None
        self.source: torch.Tensor | None = None
        self.modality: torch.Tensor | None = None
        self.positions = 0
        self._mask_count: tuple[torch.Tensor, torch.Tensor] | None = None
        # waiting for the step's batched scan, and scan rows already taken (tensor probes)
        self.entries: list[Entry] = []
        self.scan_rows: list[tuple[list[tuple[str, str]], torch.Tensor]] = []
        # gradients: the P0 norm [1], the group rows of the detail scan (on the host, the
        # call that reduces them off the training thread), the clipping norm and threshold
        self.g2: torch.Tensor | None = None
        self.grad_rows: (
            tuple[torch.Tensor | Callable[[], torch.Tensor], list[int], tuple[int, ...]] | None
        ) = None
        self.clip: torch.Tensor | float | None = None
        self.max_norm: float | None = None  # the threshold the loop clipped with, if it said
        self.scaler: tuple[Any, torch.Tensor] | None = None  # a GradScaler, its scale then
        self.pending_bwd: dict[str, int] = {}  # forwards whose backward hook waits (recompute)
        self.comm_waits: dict[str, float] = {}  # a new dict: a late sampler may hold the last
        self.collector.clear()

    def mask_count(self, mask: torch.Tensor) -> torch.Tensor:
        """Σ mask (float64, on the device), computed once per mask tensor."""
        cached = self._mask_count
        if cached is not None and cached[0] is mask:
            return cached[1]
        count = mask.sum(dtype=F64)
        self._mask_count = (mask, count)
        return count
