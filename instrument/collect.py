"""One step's measurements: device vectors gathered into one transfer, decoded off-thread.

During a step, probes add small device vectors under a key (``add``); a key may get one
part per micro-batch, and its decoder sees all parts, so combining micro-batches happens
on the host instead of in extra kernels. Each probe's home (``probes``) holds the device
function that makes its parts, their layout, and the decoder that reads them back.

``seal`` runs on the training thread at the end of the step. On an accelerator: one
``cat`` on the device and one non-blocking copy into a pinned host buffer followed by an
event; no host synchronisation happens there, the emitter thread waits on the event in
``SealedStep.resolve`` and decodes. On CPU there is no transfer at all: the step's small
tensors are handed over as they are and the emitter thread reads them (so tensors given
to ``micro_batch`` must not be modified in place until the step is exported).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .wire import Point

__all__ = ["Decoder", "Late", "SealedStep", "StepCollector", "host_values", "to_device"]

log = logging.getLogger(__name__)

# decoder(parts) with parts = [(values, meta), ...], one per ``add`` under the key; values
# is a float64 NumPy view of the step's host buffer (``.tolist()`` it for Python floats)
Decoder = Callable[[list[tuple[np.ndarray, Any]]], list[Point]]
Late = Callable[[], list[Point]]


def host_values(
    values: Sequence[float] | Sequence[int], device: torch.device, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """A small host-built tensor on ``device`` without a host synchronisation: on CUDA it
    is staged in pinned memory and copied asynchronously (a copy from pageable memory
    would wait for the stream)."""
    t = torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda":
        return t if device.type == "cpu" else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to CUDA through pinned memory, asynchronously."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


Slots = dict[str, tuple[Decoder, list[tuple[torch.Tensor, ...]], list[Any]]]
"""key -> (decoder, the tensors of each ``add``, the meta of each ``add``)"""


@dataclass(slots=True)
class SealedStep:
    """What the emitter thread receives: the step's parts, their host values (or pending
    copy) and how to decode them; the layout is read off the parts on the emitter thread."""

    step: int
    slots: Slots
    host: torch.Tensor | None  # the device parts' copy (pinned); None: CPU parts, read as is
    event: Any
    points: list[Point]
    late: list[Late] = field(default_factory=list)
    held: bool = False  # the scan-tier points stay in the ring buffer (``export``)
    replay: bool = False  # a replay's record: its scan-tier points go out marked replay
    retired: Any = None  # let go of with this record, on the emitter thread (tensors' frees)

    def resolve(self) -> list[Point]:
        if self.event is not None:
            self.event.synchronize()  # emitter thread: waits for the device copy only
        points = list(self.points)
        if self.slots:
            if self.host is not None:
                values = self.host.numpy()
            else:  # CPU: read the parts where they are
                values = np.concatenate(
                    [
                        t.detach().numpy().reshape(-1)
                        for _, parts, _ in self.slots.values()
                        for tensors in parts
                        for t in tensors
                    ]
                )
                values = values.astype(np.float64, copy=False)
            offset = 0
            for decode, parts, metas in self.slots.values():
                arrays = []
                for tensors, meta in zip(parts, metas):
                    width = sum(t.numel() for t in tensors)
                    arrays.append((values[offset : offset + width], meta))
                    offset += width
                points += decode(arrays)
        for sample in self.late:
            try:
                points += sample()
            except Exception:  # telemetry must never lose the step's other points
                log.exception("probewire: a late sampler failed")
        return points


class StepCollector:
    """Accumulates one step's device vectors; reused step after step by one monitor."""

    __slots__ = ("_slots", "_on_device")

    def __init__(self) -> None:
        self._slots: Slots = {}
        self._on_device = False  # a part lives off the host: seal gathers and copies

    def add(
        self,
        key: str,
        tensors: torch.Tensor | Sequence[torch.Tensor],
        decode: Decoder,
        meta: Any = None,
    ) -> None:
        """One part of ``key``: a tensor or several (any shape and real dtype; the step's one
        ``cat`` flattens them and promotes them to float64, so a part costs no kernel of its
        own). The decoder sees the part as one array, the tensors in order."""
        parts = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if not self._on_device:
            self._on_device = any(t.device.type != "cpu" for t in parts)
        slot = self._slots.get(key)
        if slot is None:
            self._slots[key] = (decode, [parts], [meta])
        else:
            slot[1].append(parts)
            slot[2].append(meta)

    def parts(self, key: str) -> list[tuple[torch.Tensor, ...]]:
        """The tensors added under ``key`` so far, one tuple per ``add``."""
        slot = self._slots.get(key)
        return [] if slot is None else list(slot[1])

    def has(self, key: str) -> bool:
        return key in self._slots

    def clear(self) -> None:
        self._slots = {}
        self._on_device = False

    def seal(
        self,
        step: int,
        points: list[Point],
        late: list[Late],
        *,
        held: bool = False,
        replay: bool = False,
    ) -> SealedStep:
        """Hand the step's parts over. On CPU nothing else happens here (the emitter thread
        reads them); with a part on a device, concatenate there and start the one
        device-to-host copy."""
        slots, host, event = self._slots, None, None
        if self._on_device:
            vectors = [t for _, parts, _ in slots.values() for tensors in parts for t in tensors]
            device = next(v.device for v in vectors if v.device.type != "cpu")
            if not any(v.dtype == torch.float64 for v in vectors):
                vectors[0] = vectors[0].to(torch.float64)  # cat promotes every part to it
            flat = torch.cat([to_device(v, device).reshape(-1) for v in vectors])
            cuda = device.type == "cuda"
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=cuda)
            host.copy_(flat, non_blocking=cuda)
            if cuda:
                event = torch.cuda.Event()
                event.record()
        self.clear()
        return SealedStep(step, slots, host, event, points, late, held, replay)
