"""Real training faults the demo can inject, each with the signature probewire should show.

``probewire demo --fault NAME[@STEP][:PARAM=VALUE,...]`` (repeatable). A fault acts on the
real training through a few hooks the demo loop calls; nothing about the measurement is
faked. Each class documents its measured signature (2 gloo ranks, detector window 50,
fault at step 120; ``tests/e2e/test_fault_gallery.py`` checks it): the P0 signal that
pages, at which step, which other P0 signals the same fault raises, and what
``probewire explain`` names. The class attributes (``signal``, ``also_pages``, ``within``,
``explain_*``) state the same signature for the tests.
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
    also_pages: ClassVar[tuple[str, ...]] = ()  # other P0 signals the same fault raises
    within: ClassVar[int] = 0    # the page comes at most this many steps after ``step``
    # what `probewire explain` at the paging step shows: a finding of this stage (and
    # signal, when given) that names explain_culprit(), scored moved when explain_moves
    explain_stage: ClassVar[str] = "gradient"
    explain_signal: ClassVar[str | None] = None
    explain_moves: ClassVar[bool] = True
    explain_gap: ClassVar[str] = ""  # why explain does not (yet) name the culprit
    demo_args: ClassVar[tuple[str, ...]] = ()   # train.py flags the signature needs
    step: int = 100

    def expected_culprit(self) -> str:
        """What the paging alert names (signals with a single culprit); "" when the step
        itself is the culprit."""
        return ""

    def explain_culprit(self) -> str:
        """What explain's finding names; "" when only the finding's movement counts."""
        return self.expected_culprit()

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

    Signature (measured, 2 ranks, window 50, fault at 120): `loss_worst_rank` pages at
    exactly ``step`` with culprit ``rank {rank}`` (L_max/L 1.03 -> 1.61, z 14). With R = 2
    ranks L carries half of the jump (2.76 -> 5.4) and the gradient norm jumps with it,
    so `cospike` also pages at ``step``; nothing else pages. explain's loss stage names
    ``rank {rank}`` (loss_worst_rank moved, onset ``step``)."""

    name: ClassVar[str] = "bad-rank"
    signal: ClassVar[str] = "loss_worst_rank"
    culprit: ClassVar[str] = "rank"
    also_pages: ClassVar[tuple[str, ...]] = ("cospike",)
    explain_stage: ClassVar[str] = "loss"
    explain_signal: ClassVar[str | None] = "loss_worst_rank"
    rank: int = 1

    def expected_culprit(self) -> str:
        return f"rank {self.rank}"

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if step < self.step or rank != self.rank:
            return batch
        g = torch.Generator().manual_seed(step)
        return _scramble(batch, torch.ones(len(batch.source), dtype=torch.bool), g)


@dataclass(kw_only=True)
class SourceRegression(Fault):
    """One data source's text is degraded from ``step`` on (random bytes in its rows).

    Signature (measured, window 50, fault at 120): L moves by the source's token share of
    the jump (L_code 2.7 -> 9.1 at a 70% code share: L 2.7 -> 7.1), so `cospike` pages at
    ``step``; `loss_by_source` (scored on L_source / L) pages for ``source {source}`` one
    step later (121: L_code / L = 1.72, z 10.7): on the fault step itself the source
    carries most of the tokens and L_source / L is diluted (1.27). The page comes within
    3 steps (it depends on the step's token share). explain's loss stage names
    ``source {source}`` (onset ``step``)."""

    name: ClassVar[str] = "source-regression"
    signal: ClassVar[str] = "loss_by_source"
    culprit: ClassVar[str] = "source"
    also_pages: ClassVar[tuple[str, ...]] = ("cospike",)
    within: ClassVar[int] = 3
    explain_stage: ClassVar[str] = "loss"
    source: str = "code"

    def expected_culprit(self) -> str:
        return f"source {self.source}"

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

    Signature (measured, window 50, fault at 120): `cospike` pages at exactly ``step``
    and nothing else pages; the alert carries no rank or source (the step is the culprit)
    and explain's gradient stage reports the co-spike at ``step`` (cospike_count moved)."""

    name: ClassVar[str] = "poisoned-batch"
    signal: ClassVar[str] = "cospike"
    culprit: ClassVar[str] = "step"
    explain_signal: ClassVar[str | None] = "cospike_count"

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if step != self.step:
            return batch
        g = torch.Generator().manual_seed(rank)
        return _scramble(batch, torch.ones(len(batch.source), dtype=torch.bool), g)


@dataclass(kw_only=True)
class LayerExplosion(Fault):
    """At ``step`` one block's MLP output weights are multiplied by ``scale``.

    Signature (measured, window 50, fault at 120): `cospike` pages at exactly ``step``
    (L 2.7 -> 4.8, G2 x12); nothing else pages (`output_absmax` moves but stays under
    z 8). With tensor probes at ``step`` (``--p1-every 10``) the forward |x|max of
    ``blocks.{layer}.mlp`` jumps x37 and nothing before it moves; backward |g|max jumps
    from ``blocks.{layer}`` inward. explain's layer walk names ``layer {layer}`` (it places
    the positional embedding ``pos`` with the embeddings, as the rank-side localisation
    does), but dates the move to an earlier natural gradient-norm blip (step 112 with
    seed 0) instead of ``step``."""

    name: ClassVar[str] = "layer-explosion"
    signal: ClassVar[str] = "cospike"
    culprit: ClassVar[str] = "layer"
    explain_stage: ClassVar[str] = "layers"
    explain_gap: ClassVar[str] = (
        "explain names layer 1 (blocks.1.mlp.up) but dates its move to a natural gradient "
        "blip 8 steps before the fault, so 'moved since the fault' is not met")
    demo_args: ClassVar[tuple[str, ...]] = ("--p1-every", "10")
    layer: int = 1
    scale: float = 30.0

    def explain_culprit(self) -> str:
        return f"layer {self.layer}"

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if step == self.step:
            core = getattr(model, "module", model)
            with torch.no_grad():
                core.blocks[self.layer].mlp.down.weight.mul_(self.scale)


@dataclass(kw_only=True)
class Straggler(Fault):
    """One rank sleeps ``delay_s`` per step for ``duration`` steps from ``step`` on
    (``duration`` 0: to the end of the run).

    Signature (measured, window 50, fault at 120): `step_time` should page at ``step``,
    but only does when the delay is large against the step time's own noise: the rule
    scores log step time against its rolling MAD (z > 8). A 0.3 s delay (the old default)
    never paged. With 3 s: on a quieter stretch (steps 45-94 of a run: step 0.060 s,
    log-MAD 0.24) the delay would reach z 11.0 (0.3 s: z 5.0); on the shared 2-core host of the measurement (step 0.24 s, log-MAD 0.52, the
    stream worker and another run competing) it reaches z 3.4 and nothing pages (step time
    0.35 -> 3.3 s); the gallery test computes the reachable z from the run's own pre-fault
    step times and xfails with that reason when it is under the threshold.
    The culprit is NOT named by stage 2 today: under synchronous DDP the fast rank waits
    for the slow one inside the gradient all-reduce, so both ranks' step times carry the
    delay and `straggler_rank` (argmax step time) is a coin toss. train.py's comm hook
    measures each rank's all-reduce wait (trace ``comm_wait_s``); step time minus that
    wait names ``rank {rank}`` on every slow step."""

    name: ClassVar[str] = "straggler"
    signal: ClassVar[str] = "step_time"
    culprit: ClassVar[str] = "rank"
    explain_stage: ClassVar[str] = "step time"
    explain_signal: ClassVar[str | None] = "step_time_s"
    explain_gap: ClassVar[str] = (
        "stage 2's straggler_rank is argmax step_time_s, which under synchronous DDP carries "
        "the delay on every rank (the fast rank waits in the gradient all-reduce); needs "
        "comm.wait_s{op=ddp_allreduce} every step and argmax(step_time_s - wait)")
    rank: int = 1
    delay_s: float = 3.0
    duration: int = 10

    def expected_culprit(self) -> str:
        return f"rank {self.rank}"

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if rank == self.rank and step >= self.step and (
                not self.duration or step < self.step + self.duration):
            time.sleep(self.delay_s)


@dataclass(kw_only=True)
class MemoryCreep(Fault):
    """One rank retains ``mib_per_step`` MiB more every step from ``step`` on.

    Signature (measured, window 50, fault at 120): `peak_memory` pages once the peak
    RSS exceeds its post-warm-up baseline (median of the first ``window`` steps, ~354 MiB)
    by ``stream.memory_growth`` (20%): at step 126, culprit ``rank {rank}``; with the
    default 8 MiB/step the page comes within 10 steps of ``step``. Nothing else pages.
    explain's memory stage names ``rank {rank}`` (peak_memory_rank, "+21% over the
    scanned steps") but does not score it as moved: it scores the peak against its own
    Theil-Sen trend, which follows a steady creep."""

    name: ClassVar[str] = "memory-creep"
    signal: ClassVar[str] = "peak_memory"
    culprit: ClassVar[str] = "rank"
    within: ClassVar[int] = 10
    explain_stage: ClassVar[str] = "memory"
    explain_signal: ClassVar[str | None] = "peak_memory_bytes"
    explain_moves: ClassVar[bool] = False
    rank: int = 1
    mib_per_step: float = 8.0
    _held: list[torch.Tensor] = field(default_factory=list, repr=False)

    def expected_culprit(self) -> str:
        return f"rank {self.rank}"

    def on_step_end(self, step: int, rank: int) -> None:
        if step >= self.step and rank == self.rank:
            block = torch.ones(int(self.mib_per_step * (1 << 20)) // 4)  # touched: resident
            self._held.append(block)


@dataclass(kw_only=True)
class FlakyReplay(Fault):
    """The spike guard replays ``step`` and the replay does not reproduce the loss.

    The replay flips the lowest exponent bit of one output weight (train.py); the old low
    mantissa bit of a rare byte's weight moved the replayed loss by less than the guard's
    1e-6 tolerance, and nothing paged.

    Signature (measured, window 50, fault at 120): `replay_mismatch` pages at exactly
    ``step`` with culprit "hardware: a replay did not reproduce its loss"; nothing else
    pages. explain's job-state stage shows replay_mismatch (and replayed) moved at
    ``step``."""

    name: ClassVar[str] = "flaky-replay"
    signal: ClassVar[str] = "replay_mismatch"
    culprit: ClassVar[str] = "hardware"
    explain_stage: ClassVar[str] = "job state"
    explain_signal: ClassVar[str | None] = "replay_mismatch"

    def expected_culprit(self) -> str:
        return "hardware"

    def explain_culprit(self) -> str:
        return ""  # explain's replay_mismatch finding carries no culprit text

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
