"""One step's measurements: device vectors gathered into one transfer, decoded off-thread.

During a step, probes add small float64 device vectors under a key (``add``); a key may
get one part per micro-batch, and its decoder sees all parts, so combining micro-batches
happens on the host instead of in extra kernels. Tensor scans go through ``add_scan``
and are combined per (tensor, kind) with one segment reduction at the end.

``seal`` runs on the training thread at the end of the step. On an accelerator: one
``cat`` on the device and one non-blocking copy into a pinned host buffer followed by an
event; no host synchronisation happens there, the emitter thread waits on the event in
``SealedStep.resolve`` and decodes. On CPU there is no transfer at all: the step's small
tensors are handed over as they are and the emitter thread reads them (so tensors given
to ``micro_batch`` must not be modified in place until the step is exported).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .otlp import Point
from .probes import host_values, to_device
from .scan import ScanFields

__all__ = ["Decoder", "SealedStep", "StepCollector", "scan_points"]

log = logging.getLogger(__name__)

# decoder(parts) with parts = [(values, meta), ...], one per ``add`` under the key; values
# is a float64 NumPy view of the step's host buffer (``.tolist()`` it for Python floats)
Decoder = Callable[[list[tuple[np.ndarray, Any]]], list[Point]]
Late = Callable[[], list[Point]]

_SCAN_NAMES = ("tensor.n", "tensor.sum", "tensor.sum_sq", "tensor.abs_sum", "tensor.abs_max",
               "tensor.zeros", "tensor.nonfinite", "tensor.sum3", "tensor.sum4")


def scan_points(values: Sequence[float], labels: tuple[tuple[str, str], ...]) -> list[Point]:
    """tensor.* points of one (reduced) scan vector; nothing for an empty tensor."""
    if not values[ScanFields.N]:
        return []
    return [Point(name, v, labels) for name, v in zip(_SCAN_NAMES, values)]


@dataclass(slots=True)
class SealedStep:
    """What the emitter thread receives: host (or pending) values plus how to decode them."""

    step: int
    host: torch.Tensor | list[torch.Tensor] | None   # pinned buffer, or CPU parts
    event: Any
    layout: list[tuple[Decoder, list[tuple[int, Any]]]]
    points: list[Point]
    late: list[Late] = field(default_factory=list)

    def resolve(self) -> list[Point]:
        if self.event is not None:
            self.event.synchronize()  # emitter thread: waits for the device copy only
        points = list(self.points)
        if self.host is not None:
            if isinstance(self.host, list):  # CPU: read the parts where they are
                values = np.concatenate([t.detach().numpy().reshape(-1) for t in self.host])
                values = values.astype(np.float64, copy=False)
            else:
                values = self.host.numpy()
            offset = 0
            for decode, widths in self.layout:
                parts = []
                for width, meta in widths:
                    parts.append((values[offset:offset + width], meta))
                    offset += width
                points += decode(parts)
        for sample in self.late:
            try:
                points += sample()
            except Exception:  # telemetry must never lose the step's other points
                log.exception("probewire: a late sampler failed")
        return points


class StepCollector:
    """Accumulates one step's device vectors; reused step after step by one monitor."""

    __slots__ = ("_slots", "_scan_keys", "_scan_blocks", "_scan_index", "_scan_labels")

    def __init__(self) -> None:
        self._slots: dict[str, tuple[Decoder, list[tuple[torch.Tensor, ...]], list[Any]]] = {}
        self._scan_keys: dict[tuple[str, str], int] = {}
        self._scan_labels: list[tuple[tuple[str, str], ...]] = []
        self._scan_blocks: list[torch.Tensor] = []   # [k, fields] rows
        self._scan_index: list[int] = []              # key slot of every row, in order

    def add(self, key: str, tensors: torch.Tensor | Sequence[torch.Tensor], decode: Decoder,
            meta: Any = None) -> None:
        """One part of ``key``: a tensor or several (any shape and real dtype; the step's one
        ``cat`` flattens them and promotes them to float64, so a part costs no kernel of its
        own). The decoder sees the part as one array, the tensors in order."""
        parts = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        slot = self._slots.get(key)
        if slot is None:
            self._slots[key] = (decode, [parts], [meta])
        else:
            slot[1].append(parts)
            slot[2].append(meta)

    def add_scan(self, tensor: str, kind: str, vec: torch.Tensor) -> None:
        """A scan vector of one observation; vectors of the same (tensor, kind) combine."""
        self.add_scan_rows([(tensor, kind)], vec.unsqueeze(0))

    def add_scan_rows(self, keys: Sequence[tuple[str, str]], rows: torch.Tensor) -> None:
        """Scan rows [k, fields] of k observations named by (tensor, kind) ``keys``."""
        for key in keys:
            slot = self._scan_keys.get(key)
            if slot is None:
                slot = self._scan_keys[key] = len(self._scan_labels)
                self._scan_labels.append((("tensor", key[0]), ("kind", key[1])))
            self._scan_index.append(slot)
        self._scan_blocks.append(rows)

    def clear(self) -> None:
        self._slots = {}
        self._scan_keys, self._scan_labels = {}, []
        self._scan_blocks, self._scan_index = [], []

    def _combined_scans(self) -> torch.Tensor:
        blocks = self._scan_blocks
        stacked = torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        keys = len(self._scan_labels)
        if keys == stacked.shape[0]:  # one observation per key, already in order
            return stacked.reshape(-1)
        index = host_values(self._scan_index, stacked.device)
        out = torch.zeros(keys, stacked.shape[1], dtype=stacked.dtype, device=stacked.device)
        out.index_add_(0, index, stacked)
        out[:, ScanFields.ABS_MAX] = torch.zeros(
            keys, dtype=stacked.dtype, device=stacked.device).scatter_reduce_(
            0, index, stacked[:, ScanFields.ABS_MAX], "amax", include_self=True)
        return out.reshape(-1)

    def seal(self, step: int, points: list[Point], late: list[Late]) -> SealedStep:
        """Concatenate on the device, start the one device-to-host copy, hand over."""
        vectors: list[torch.Tensor] = []
        layout: list[tuple[Decoder, list[tuple[int, Any]]]] = []
        for decode, parts, metas in self._slots.values():
            widths = []
            for tensors, meta in zip(parts, metas):
                vectors += tensors
                widths.append((sum(t.numel() for t in tensors), meta))
            layout.append((decode, widths))
        if self._scan_blocks:
            width = self._scan_blocks[0].shape[1]
            labels = self._scan_labels
            scans = self._combined_scans()
            vectors.append(scans)

            def decode_scans(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
                values = parts[0][0].tolist()
                out: list[Point] = []
                for i, lab in enumerate(labels):
                    out += scan_points(values[i * width:(i + 1) * width], lab)
                return out

            layout.append((decode_scans, [(scans.shape[0], None)]))
        host: torch.Tensor | list[torch.Tensor] | None = None
        event = None
        if vectors:
            device = vectors[0].device
            if device.type == "cpu" and all(v.device.type == "cpu" for v in vectors):
                host = vectors
            else:
                if not any(v.dtype == torch.float64 for v in vectors):
                    vectors[0] = vectors[0].to(torch.float64)  # cat promotes every part to it
                flat = torch.cat([to_device(v, device).reshape(-1) for v in vectors])
                cuda = device.type == "cuda"
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=cuda)
                host.copy_(flat, non_blocking=cuda)
                if cuda:
                    event = torch.cuda.Event()
                    event.record()
        sealed = SealedStep(step, host, event, layout, points, late)
        self.clear()
        return sealed
