"""Explosion localisation (seeds 001 §6, "Reading an explosion"): walk the backward
absolute maxima inward from the output and name the first layer that jumps.

Pure and torch-free, so the stream, ``explain`` or a notebook can call it. Input per step:
the backward ``tensor.abs_max`` of each observed tensor (kind ``bwd``, the gradient w.r.t.
a module's output; kind ``grad`` works the same). Tensors are grouped into layers by name:

* ``output``: everything after the last block (logits head, final norm, MTP heads),
* ``<prefix>.N`` (``blocks.N``, ``model.layers.N``, ``transformer.h.N``): block N and
  everything inside it (attention, feed-forward, experts),
* ``embeddings``: token and position embeddings.

Each tensor keeps its own robust detector (``probewire.stream.detect.RobustSpikeDetector``:
z = 0.6745·|u − median| / MAD on u = log(x + ε), upward moves and non-finite values only),
and the walk goes output → last block → … → first block → embeddings; the first layer
holding a spiking tensor is named, with that tensor. Per tensor rather than per layer
maximum: when a block's weights blow up in a pre-norm model, the final norm divides the
grown stream back down, so the backward maxima of the layers nearer the output *fall*;
the jump shows inside the culprit block (e.g. the gradient reaching its feed-forward's
first projection, multiplied by the scaled weights), where a layer-wide maximum can hide
it under a larger, steady residual-stream gradient. Every detector is updated at every
step, so a tensor's history never depends on where the walk stopped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .detect import RobustSpikeDetector, SpikeResult

__all__ = [
    "ExplosionLocator",
    "Localisation",
    "layer_of_tensor",
    "layer_views",
    "walk_order",
]

_BLOCK = re.compile(r"^(.*?(?:^|\.)(?:layers|blocks|h|layer)\.(\d+))(?:\.|$)")
_EMBED = re.compile(
    r"(.*\.)?(embed\w*|wte|wpe|pos|tok_embeddings|word_embeddings|"
    r"position_embeddings)(\..*)?"
)


def layer_of_tensor(tensor: str) -> tuple[float, str]:
    """(depth, layer key) of a tensor name: embeddings −1, block N → N, output +inf."""
    match = _BLOCK.match(tensor)
    if match is not None:
        return float(match.group(2)), match.group(1)
    if _EMBED.fullmatch(tensor):
        return -1.0, "embeddings"
    return math.inf, "output"


def layer_views(values: Mapping[str, float]) -> dict[str, float]:
    """Per-tensor backward abs maxima -> per-layer maximum (NaN propagates: it must show)."""
    out: dict[str, float] = {}
    for tensor, value in values.items():
        _, key = layer_of_tensor(tensor)
        value = float(value)
        prev = out.get(key)
        out[key] = (
            value
            if prev is None or math.isnan(value) or (not math.isnan(prev) and value > prev)
            else prev
        )
    return out


def walk_order(layers: Iterable[str]) -> list[str]:
    """Layer keys from the output inward: output, last block, ..., first block, embeddings."""
    depth = {}
    for key in layers:
        match = _BLOCK.match(key)
        depth[key] = float(match.group(2)) if match else -1.0 if key == "embeddings" else math.inf
    return sorted(depth, key=lambda k: (-depth[k], k))


@dataclass(frozen=True, slots=True)
class Localisation:
    """The named layer, the tensor in it that jumped most (largest z), its value, its
    baseline (exp of its window median), its z, and the walk as (layer, largest z) up to and
    including the named layer (z None while a layer is warming up)."""

    layer: str
    tensor: str
    value: float
    baseline: float | None
    z: float | None
    walked: tuple[tuple[str, float | None], ...] = field(default=())


@dataclass(kw_only=True)
class ExplosionLocator:
    """One robust detector per tensor; ``update`` once per measured step."""

    window: int = 20
    min_history: int = 5
    threshold: float = 6.0
    _detectors: dict[str, RobustSpikeDetector] = field(default_factory=dict, repr=False)

    def update(self, values: Mapping[str, float]) -> Localisation | None:
        """Score this step's per-tensor values; walking the layers from the output inward,
        the first layer with a spiking tensor, or None (nothing jumped, or only tensors
        still warming up)."""
        layers: dict[str, list[tuple[str, SpikeResult]]] = {}
        for tensor in sorted(values):
            detector = self._detectors.get(tensor)
            if detector is None:
                detector = self._detectors[tensor] = RobustSpikeDetector(
                    window=self.window, min_history=self.min_history, threshold=self.threshold
                )
            layers.setdefault(layer_of_tensor(tensor)[1], []).append(
                (tensor, detector.update(float(values[tensor])))
            )
        walked: list[tuple[str, float | None]] = []
        for layer in walk_order(layers):
            scored = layers[layer]
            zs = [r.z for _, r in scored if r.z is not None]
            walked.append((layer, max(zs) if zs else None))
            spikes = [(t, r) for t, r in scored if r.spike]
            if spikes:
                tensor, r = max(spikes, key=lambda tr: math.inf if tr[1].z is None else tr[1].z)
                baseline = None if r.median is None else math.exp(r.median)
                return Localisation(layer, tensor, r.x, baseline, r.z, tuple(walked))
        return None
