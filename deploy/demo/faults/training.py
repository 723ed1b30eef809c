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
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar

import torch

from probewire.stream.series import StepMetrics as SM

from ..data import SOURCES, Batch
from ..model import IGNORE, PRESETS
from .base import Fault, FaultError, _core, _scramble
from .structure import Bf16Swallow, IgnoredMedia, RoutingCollapse

__all__ = [  # its own names; the package (``__init__``) re-exports the whole vocabulary
    "FAULTS",
    "MANY_RANKS",
    "SCENARIOS",
    "BadRank",
    "EasyBatch",
    "FlakyReplay",
    "LabelShuffle",
    "LayerExplosion",
    "MemoryCreep",
    "NanWeight",
    "PoisonedBatch",
    "SourceRegression",
    "Straggler",
    "demo_train_args",
    "parse_fault",
]


@dataclass(kw_only=True)
class BadRank(Fault):
    """One rank's batches are corrupted from ``step`` on (random bytes).

    Signature (measured, 2 ranks, window 50, fault at 120): `loss_worst_rank` pages at
    exactly ``step`` with culprit ``rank {rank}``: the rank's own loss jumps against its
    own history (2.75 -> 8.7, z 19) and L_max / L with it. With R = 2 ranks L carries half
    of the jump and the gradient norm jumps with it, so `cospike` also pages at ``step``
    (its later co-spikes update that page's record); nothing else pages. explain's
    headline at the page names loss_worst_rank and ``rank {rank}``; its loss stage names
    ``rank {rank}`` (loss_worst_rank moved, onset ``step``)."""

    name: ClassVar[str] = "bad-rank"
    signal: ClassVar[str] = SM.loss_worst_rank
    culprit: ClassVar[str] = "rank"
    also_pages: ClassVar[tuple[str, ...]] = (SM.cospike,)
    explain_stage: ClassVar[str] = "loss"
    explain_signal: ClassVar[str | None] = SM.loss_worst_rank
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
    also_pages: ClassVar[tuple[str, ...]] = (SM.cospike,)
    within: ClassVar[int] = 3
    explain_stage: ClassVar[str] = "loss"
    source: str = "code"
    per_step: float = 0.0  # > 0: a share per_step more of the rows each step (a drift)

    def expected_culprit(self) -> str:
        return f"source {self.source}"

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if step < self.step:
            return batch
        if self.source not in SOURCES:
            raise FaultError(
                f"source-regression: unknown source {self.source!r}; "
                f"sources are {', '.join(SOURCES)}"
            )
        g = torch.Generator().manual_seed(10_000 + step)
        rows = batch.source == SOURCES.index(self.source)
        if self.per_step > 0:
            share = min(1.0, self.per_step * (step - self.step + 1))
            rows = rows & (torch.rand(len(rows), generator=g) < share)
        return _scramble(batch, rows, g)


@dataclass(kw_only=True)
class PoisonedBatch(Fault):
    """At ``step`` every rank trains on one batch of a single repeated junk byte pattern
    (a batch far from the data), with a learning-rate bump: loss and gradient spike together.

    Signature (measured, window 50, fault at 120): `cospike` pages at exactly ``step``
    and nothing else pages; the alert carries no rank or source (the step is the culprit)
    and explain's gradient stage reports the co-spike at ``step`` (cospike_count moved)."""

    name: ClassVar[str] = "poisoned-batch"
    signal: ClassVar[str] = SM.cospike
    culprit: ClassVar[str] = "step"
    explain_signal: ClassVar[str | None] = SM.cospike_count
    repeat_after: int = 0  # > 0: a second poisoned batch this many steps later

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if step != self.step and not (self.repeat_after and step == self.step + self.repeat_after):
            return batch
        g = torch.Generator().manual_seed(rank + 97 * (step - self.step))
        return _scramble(batch, torch.ones(len(batch.source), dtype=torch.bool), g)


@dataclass(kw_only=True)
class EasyBatch(Fault):
    """For ``steps`` steps from ``step`` one rank draws an easy batch: every valid target is
    what the model itself predicts (the argmax of its own logits), so that rank's mean loss
    falls while the other ranks are normal.

    Signature (measured, 2 ranks, window 50, fault at 120): rank 0's loss 2.75 -> 1.50
    while rank 1's stays at 2.8; L falls and L_max / L jumps (1.03 -> 1.35, z 8.4), carried
    by a rank whose own loss did not move. Nothing pages (`loss_worst_rank` pages on the
    worst rank's own loss against its own history, and L falling is not a spike); the gap
    is recorded as a `loss_worst_rank` anomaly of kind ``gap`` naming rank 1. In simulated
    runs (``simulate``) the rank's loss is ``loss_scale`` x its own."""

    name: ClassVar[str] = "easy-batch"
    signal: ClassVar[str] = ""  # pages nothing
    culprit: ClassVar[str] = "rank"
    explain_stage: ClassVar[str] = "loss"
    explain_signal: ClassVar[str | None] = SM.loss_worst_rank
    explain_moves: ClassVar[bool] = False
    rank: int = 0
    steps: int = 1
    loss_scale: float = 0.55
    _model: Any = field(default=None, repr=False)

    def explain_culprit(self) -> str:
        return ""

    def on_step_start(self, step, rank, model, optimizer) -> None:
        self._model = _core(model)

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if (
            rank != self.rank
            or not self.step <= step < self.step + self.steps
            or self._model is None
        ):
            return batch
        with torch.no_grad():
            guess = self._model(batch.tokens, batch.media, batch.media_mask).argmax(-1)
        return replace(batch, targets=torch.where(batch.targets == IGNORE, batch.targets, guess))


@dataclass(kw_only=True)
class LabelShuffle(Fault):
    """A broken data shard: from ``step`` on, ``fraction`` of one rank's rows get another
    row's targets (a permutation of the rows' labels; padding stays padding), while the
    inputs stay the real text. That rank's own loss L_r rises and stays up; L rises by a
    quarter of it with 4 ranks. Paged by ``loss_rank_shift`` (L_r over the other ranks'
    median, a CUSUM: 3 or more ranks) naming the rank, or by ``loss_worst_rank`` when the
    first shuffled step is a spike of that rank's own loss. In ``MANY_RANKS``: the
    2-rank fault gallery cannot show it."""

    name: ClassVar[str] = "label-shuffle"
    signal: ClassVar[str] = "loss_rank_shift"
    culprit: ClassVar[str] = "rank"
    explain_stage: ClassVar[str] = "loss"
    explain_signal: ClassVar[str | None] = SM.loss_worst_rank
    rank: int = 1
    fraction: float = 0.25

    def expected_culprit(self) -> str:
        return f"rank {self.rank}"

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        if step < self.step or rank != self.rank:
            return batch
        g = torch.Generator().manual_seed(step)
        rows = len(batch.targets)
        chosen = torch.rand(rows, generator=g) < self.fraction
        moved = torch.roll(batch.targets, 1, dims=0)  # each row gets the previous row's labels
        use = chosen[:, None] & (batch.targets != IGNORE) & (moved != IGNORE)
        return replace(batch, targets=torch.where(use, moved, batch.targets))


@dataclass(kw_only=True)
class LayerExplosion(Fault):
    """At ``step`` one block's MLP output weights are multiplied by ``scale``.

    Signature (measured, window 50, fault at 120): `cospike` pages at exactly ``step``
    (L 2.7 -> 4.8, G2 x12); nothing else pages (`output_absmax` moves but stays under
    z 8). With tensor probes at ``step`` (``--p1-every 10``) the forward |x|max of
    ``blocks.{layer}.mlp`` jumps x37 and nothing before it moves; backward |g|max jumps
    from ``blocks.{layer}`` inward. explain's layer walk names ``layer {layer}`` (it places
    the positional embedding ``pos`` with the embeddings, as the rank-side localisation
    does) with onset ``step``: the onset is where the walk starts naming that layer on
    every step up to the explained one, so a natural |g|max blip 8 steps earlier (seed 0;
    it once dated the move there) is another episode."""

    name: ClassVar[str] = "layer-explosion"
    signal: ClassVar[str] = SM.cospike
    culprit: ClassVar[str] = "layer"
    explain_stage: ClassVar[str] = "layers"
    demo_args: ClassVar[tuple[str, ...]] = ("--p1-every", "10")
    layer: int = 1
    scale: float = 30.0

    def explain_culprit(self) -> str:
        return f"layer {self.layer}"

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if step == self.step:
            core = _core(model)
            with torch.no_grad():
                core.blocks[self.layer].mlp.down.weight.mul_(self.scale)


@dataclass(kw_only=True)
class Straggler(Fault):
    """One rank sleeps ``delay_s`` per step for ``duration`` steps from ``step`` on
    (``duration`` 0: to the end of the run); with ``factor`` > 0 it sleeps (factor - 1) x
    its median step time before ``step`` instead ("slowed by half its step": factor 1.5).

    Signature (measured, window 50, fault at 120): `step_time` pages by ``step`` + 2,
    culprit ``rank {rank}``; `compute_rate` may page with it (the compute rate Φ is the
    step's FLOPs over the job's step time, which the slow rank holds back: the same event,
    seen as lost throughput); nothing else pages. Under synchronous DDP the fast rank
    waits for the slow one inside the gradient all-reduce, so both ranks' step times carry
    the delay (argmax step time is a coin toss). train.py's comm hook times each rank's
    all-reduce wait and reports it every step (``s.comm_wait``, comm.wait{op=
    ddp_allreduce}; trace ``comm_wait_s``); stage 2 names the rank with the largest own
    time, step time minus that wait, as ``straggler_rank``, with ``straggler_own_ratio`` =
    its own time / the other ranks' median (the seeds' S = τ / median τ_r stays ~1 here).
    A sleep of 1 s or more makes the rank's own-time ratio ~20 on the demo's ~40 ms steps
    (the waiting rank's own time is floored at 5 % of tau) against a baseline of ~1: the
    brief rule (x ``straggler_ratio`` 5 on 3 consecutive steps, the job's step time then
    25-75x its median, over ``straggler_job_slowdown`` 1.2) pages at ``step`` + 2, and
    so does the whole job's step time, a spike on 3 steps in a row, naming the rank whose
    own time carries it. A rank slowed by half its step (``factor=1.5``; 3 ranks, heavier
    steps, ``tests/e2e/test_demo_pages.py``) holds its ratio on every slow step and the held rule
    (x ``straggler_held_ratio`` on 9 steps in 10 of 40) pages some 30-40 steps in, while
    a host loaded by a CPU burner, which slows ranks in bursts, pages nothing. explain's
    step-time stage names ``rank {rank}`` (straggler_rank) with straggler_own_ratio moved
    since ``step`` and notes the rank's own time."""

    name: ClassVar[str] = "straggler"
    signal: ClassVar[str] = "step_time"
    also_pages: ClassVar[tuple[str, ...]] = (SM.compute_rate,)
    culprit: ClassVar[str] = "rank"
    within: ClassVar[int] = 2  # stream.straggler_steps - 1: the third slow step pages
    explain_stage: ClassVar[str] = "step time"
    explain_signal: ClassVar[str | None] = SM.straggler_own_ratio
    rank: int = 1
    delay_s: float = 3.0
    duration: int = 10
    factor: float = 0.0  # > 0: sleep (factor - 1) x this rank's median step time before
    #                       ``step`` instead of delay_s (1.5: "slowed by half its step")
    _started: float | None = field(default=None, repr=False)
    _durations: list[float] = field(default_factory=list, repr=False)

    def expected_culprit(self) -> str:
        return f"rank {self.rank}"

    def delay(self) -> float:
        """The sleep per slow step: delay_s, or (factor - 1) x the median step time this
        rank measured (step start to step end) over the last 50 steps before ``step``."""
        if self.factor <= 0:
            return self.delay_s
        recent = sorted(self._durations[-50:])
        return (self.factor - 1.0) * recent[len(recent) // 2] if recent else 0.0

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if rank != self.rank:
            return
        if step >= self.step and (not self.duration or step < self.step + self.duration):
            time.sleep(self.delay())
        self._started = time.perf_counter()

    def on_step_end(self, step: int, rank: int) -> None:
        if rank == self.rank and step < self.step and self._started is not None:
            self._durations.append(time.perf_counter() - self._started)


@dataclass(kw_only=True)
class MemoryCreep(Fault):
    """One rank retains ``mib_per_step`` MiB more every step from ``step`` on.

    Signature (measured, window 50, fault at 120): `peak_memory` pages once the peak
    RSS exceeds its post-warm-up baseline (median of the first ``window`` steps, ~354 MiB)
    by ``stream.memory_growth`` (20%): at step 126, culprit ``rank {rank}``; with the
    default 8 MiB/step the page comes within 10 steps of ``step`` (129 in the last
    measurement, baseline 350 MiB). Nothing else pages. explain's memory stage names
    ``rank {rank}`` (peak_memory_rank) and scores the peak as moved (x1.12 over its
    Theil-Sen trend, onset 122)."""

    name: ClassVar[str] = "memory-creep"
    signal: ClassVar[str] = "peak_memory"
    culprit: ClassVar[str] = "rank"
    within: ClassVar[int] = 10
    explain_stage: ClassVar[str] = "memory"
    explain_signal: ClassVar[str | None] = SM.peak_memory_bytes
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
    signal: ClassVar[str] = SM.replay_mismatch
    culprit: ClassVar[str] = "hardware"
    explain_stage: ClassVar[str] = "job state"
    explain_signal: ClassVar[str | None] = SM.replay_mismatch

    def expected_culprit(self) -> str:
        return "hardware"

    def explain_culprit(self) -> str:
        return ""  # explain's replay_mismatch finding carries no culprit text

    def replay_differs(self, step: int) -> bool:
        return step == self.step


@dataclass(kw_only=True)
class NanWeight(Fault):
    """At ``step`` one weight of rank ``rank``'s copy of block ``layer``'s MLP output
    becomes NaN (one rank's memory silently corrupted): that rank's loss is NaN, DDP's
    all-reduce carries its NaN gradients to every rank, and the clipped update makes every
    weight NaN, so from ``step + 1`` on every rank's loss is NaN.

    Signature (measured, window 50, fault at 120): `loss` pages at exactly ``step`` as
    non-finite (NaN), with no culprit on the alert; `grad_norm` and `output_absmax` page
    non-finite at the same step; nothing else pages, and no later step pages again within
    the episode. L_max is NaN on rank ``rank`` at ``step`` (a NaN rank mean counts as the
    worst). explain's headline names the loss "carried by rank {rank}", and its loss stage
    names ``rank {rank}`` (loss_worst_rank moved, onset ``step``). The rank reaches the
    store with its NaN: a non-finite loss sum is a measurement, not a refused message."""

    name: ClassVar[str] = "nan-weight"
    signal: ClassVar[str] = SM.loss
    culprit: ClassVar[str] = "rank"
    also_pages: ClassVar[tuple[str, ...]] = (SM.grad_norm, SM.output_absmax)
    explain_stage: ClassVar[str] = "loss"
    explain_signal: ClassVar[str | None] = SM.loss_worst_rank
    rank: int = 1
    layer: int = 1

    def explain_culprit(self) -> str:
        return f"rank {self.rank}"

    def on_step_start(self, step, rank, model, optimizer) -> None:
        if step == self.step and rank == self.rank:
            with torch.no_grad():
                _core(model).blocks[self.layer].mlp.down.weight[0, 0] = float("nan")


FAULTS: dict[str, type[Fault]] = {
    cls.name: cls
    for cls in (
        BadRank,
        SourceRegression,
        PoisonedBatch,
        LayerExplosion,
        Straggler,
        MemoryCreep,
        RoutingCollapse,
        IgnoredMedia,
        Bf16Swallow,
        FlakyReplay,
        NanWeight,
    )
}
"""The fault gallery: each fault pages its ``signal``. Scenario faults that must page
nothing (``easy-batch``) are in ``SCENARIOS``, faults that need 3 or more ranks in
``MANY_RANKS``; ``parse_fault`` knows all three."""

MANY_RANKS: dict[str, type[Fault]] = {cls.name: cls for cls in (LabelShuffle,)}

SCENARIOS: dict[str, type[Fault]] = {cls.name: cls for cls in (EasyBatch,)}


def parse_fault(text: str) -> Fault:
    """``NAME[@STEP][:PARAM=VALUE,...]`` -> a Fault; a clear FaultError otherwise."""
    head, _, params = text.partition(":")
    name, _, step = head.partition("@")
    cls = FAULTS.get(name.strip()) or SCENARIOS.get(name.strip()) or MANY_RANKS.get(name.strip())
    if cls is None:
        names = sorted({*FAULTS, *SCENARIOS, *MANY_RANKS})
        raise FaultError(f"unknown fault {name!r}; known: {', '.join(names)}")
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
            raise FaultError(
                f"{name}: bad parameter {item!r}; parameters: "
                f"{', '.join(sorted(k for k in known if k != 'step'))}"
            )
        kind = type(getattr(cls(), key))
        try:
            kwargs[key] = kind(value)
        except ValueError:
            raise FaultError(f"{name}: {key} must be {kind.__name__}, got {value!r}") from None
    return cls(**kwargs)


def demo_train_args(specs: list[str], preset: str | None = None) -> list[str]:
    """The train.py flags for a demo with the faults ``specs`` (``--fault`` texts): the
    model preset (``preset``, or the first one every fault applies to), each fault's own
    flags (once each), then the faults. A FaultError for a bad spec or when the preset does
    not suit a fault."""
    faults = [parse_fault(text) for text in specs]
    if preset is not None and preset not in PRESETS:
        raise FaultError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    if preset is None:
        preset = next(
            (
                p
                for f in faults
                for p in f.presets
                if all(not g.presets or p in g.presets for g in faults)
            ),
            "tiny",
        )
    for fault in faults:
        fault.check_preset(preset)
    args = ["--preset", preset]
    for fault in faults:
        for flag, value in zip(fault.demo_args[::2], fault.demo_args[1::2]):
            if flag not in args:
                args += [flag, value]
    for text in specs:
        args += ["--fault", text]
    return args
