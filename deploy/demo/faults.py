"""Real training faults the demo can inject, each with the signature probewire should show.

``probewire demo --fault NAME[@STEP][:PARAM=VALUE,...]`` (repeatable). A fault acts on the
real training through a few hooks the demo loop calls; nothing about the measurement is
faked. Each class documents its expected signature: the P0 signal that pages, at which
step, and what ``probewire explain`` should name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

from .data import SOURCES, Batch
from .model import IGNORE

__all__ = ["FAULTS", "Fault", "FaultError", "parse_fault"]


class FaultError(ValueError):
    """A --fault argument that cannot be parsed; the message says what is wrong."""


@dataclass(kw_only=True)
class Fault:
    """A fault starting at ``step``; subclasses override the hooks they need."""

    name: ClassVar[str]
    signal: ClassVar[str]        # the P0 signal that pages
    culprit: ClassVar[str]       # what `explain` names
    step: int = 100

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        return batch

    def on_step_start(self, step: int, rank: int, model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer) -> None:
        return None

    def on_step_end(self, step: int, rank: int) -> None:
        return None

    def replay_differs(self, step: int) -> bool:
        """Whether the spike guard's replay of ``step`` fails to reproduce its loss."""
        return False


def _scramble(batch: Batch, rows: torch.Tensor, generator: torch.Generator) -> Batch:
    """Replace the bytes of the selected rows with uniform random bytes (valid positions)."""
    tokens, targets = batch.tokens.clone(), batch.targets.clone()
    noise = torch.randint(0, 256, targets.shape, generator=generator)
    keep = targets == IGNORE
    new_targets = torch.where(keep | ~rows[:, None], targets, noise)
    tokens[:, 1:] = torch.where(rows[:, None], new_targets[:, :-1].clamp(min=0), tokens[:, 1:])
    return Batch(tokens, new_targets, batch.source)


@dataclass(kw_only=True)
class BadRank(Fault):
    """One rank's batches are corrupted from ``step`` on (random bytes).

    Signature: `loss_worst_rank` pages at ``step`` (L_max/L jumps; L moves by ~1/R of it);
    explain names ``rank {rank}``."""

    name: ClassVar[str] = "bad-rank"
    signal: ClassVar[str] = "loss_worst_rank"
    culprit: ClassVar[str] = "rank"
    rank: int = 1

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if step < self.step or rank != self.rank:
            return batch
        g = torch.Generator().manual_seed(step)
        return _scramble(batch, torch.ones(len(batch.source), dtype=torch.bool), g)


@dataclass(kw_only=True)
class SourceRegression(Fault):
    """One data source's text is degraded from ``step`` on (random bytes in its rows).

    Signature: `loss_by_source` pages at ``step`` for that source while L moves by its
    token share only; explain names ``source {source}``."""

    name: ClassVar[str] = "source-regression"
    signal: ClassVar[str] = "loss_by_source"
    culprit: ClassVar[str] = "source"
    source: str = "code"

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if step < self.step:
            return batch
        if self.source not in SOURCES:
            raise FaultError(f"source-regression: unknown source {self.source!r}; "
                             f"sources are {', '.join(SOURCES)}")
        rows = batch.source == SOURCES.index(self.source)
        return _scramble(batch, rows, torch.Generator().manual_seed(10_000 + step))


@dataclass(kw_only=True)
class PoisonedBatch(Fault):
    """At ``step`` every rank trains on one batch of a single repeated junk byte pattern
    (a batch far from the data), with a learning-rate bump: loss and gradient spike together.

    Signature: `cospike` pages at exactly ``step``; explain names the co-spike."""

    name: ClassVar[str] = "poisoned-batch"
    signal: ClassVar[str] = "cospike"
    culprit: ClassVar[str] = "step"

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if step != self.step:
            return batch
        g = torch.Generator().manual_seed(rank)
        return _scramble(batch, torch.ones(len(batch.source), dtype=torch.bool), g)


@dataclass(kw_only=True)
class LayerExplosion(Fault):
    """At ``step`` one block's MLP output weights are multiplied by ``scale``.

    Signature: the gradient norm and the output abs max jump at ``step`` (`cospike` or
    `output_absmax` pages); explain's layer walk names ``blocks.{layer}``."""

    name: ClassVar[str] = "layer-explosion"
    signal: ClassVar[str] = "cospike"
    culprit: ClassVar[str] = "layer"
    layer: int = 1
    scale: float = 30.0

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if step == self.step:
            core = getattr(model, "module", model)
            with torch.no_grad():
                core.blocks[self.layer].mlp.down.weight.mul_(self.scale)


@dataclass(kw_only=True)
class Straggler(Fault):
    """One rank sleeps ``delay_s`` per step from ``step`` on.

    Signature: `step_time` pages at ``step``; the straggler score S rises; explain names
    ``rank {rank}`` (the largest local step time)."""

    name: ClassVar[str] = "straggler"
    signal: ClassVar[str] = "step_time"
    culprit: ClassVar[str] = "rank"
    rank: int = 1
    delay_s: float = 0.3

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if step >= self.step and rank == self.rank:
            time.sleep(self.delay_s)


@dataclass(kw_only=True)
class MemoryCreep(Fault):
    """One rank retains ``mib_per_step`` MiB more every step from ``step`` on.

    Signature: `peak_memory` pages once the rank's peak exceeds its baseline by the
    configured growth; explain names ``rank {rank}``."""

    name: ClassVar[str] = "memory-creep"
    signal: ClassVar[str] = "peak_memory"
    culprit: ClassVar[str] = "rank"
    rank: int = 1
    mib_per_step: float = 8.0
    _held: list[torch.Tensor] = field(default_factory=list, repr=False)

    def on_step_end(self, step: int, rank: int) -> None:
        if step >= self.step and rank == self.rank:
            block = torch.ones(int(self.mib_per_step * (1 << 20)) // 4)  # touched: resident
            self._held.append(block)


@dataclass(kw_only=True)
class FlakyReplay(Fault):
    """The spike guard replays ``step`` and the replay does not reproduce the loss.

    Signature: `replay_mismatch` pages at ``step``; explain points at hardware, not data."""

    name: ClassVar[str] = "flaky-replay"
    signal: ClassVar[str] = "replay_mismatch"
    culprit: ClassVar[str] = "hardware"

    def replay_differs(self, step: int) -> bool:
        return step == self.step


FAULTS: dict[str, type[Fault]] = {cls.name: cls for cls in (
    BadRank, SourceRegression, PoisonedBatch, LayerExplosion, Straggler, MemoryCreep,
    FlakyReplay)}


def parse_fault(text: str) -> Fault:
    """``NAME[@STEP][:PARAM=VALUE,...]`` -> a Fault; a clear FaultError otherwise."""
    head, _, params = text.partition(":")
    name, _, step = head.partition("@")
    cls = FAULTS.get(name.strip())
    if cls is None:
        raise FaultError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
    kwargs: dict[str, Any] = {}
    if step:
        if not step.isdigit():
            raise FaultError(f"{name}: step must be a non-negative integer, got {step!r}")
        kwargs["step"] = int(step)
    known = {f.name: f for f in fields(cls) if not f.name.startswith("_")}
    for item in filter(None, params.split(",")):
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in known or key == "step":
            raise FaultError(f"{name}: bad parameter {item!r}; parameters: "
                             f"{', '.join(sorted(k for k in known if k != 'step'))}")
        kind = type(getattr(cls(), key))
        try:
            kwargs[key] = kind(value)
        except ValueError:
            raise FaultError(f"{name}: {key} must be {kind.__name__}, got {value!r}") from None
    return cls(**kwargs)
