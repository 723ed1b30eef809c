"""A simulated run with the demo's faults, for tests, the docs' first-screen picture and
anyone who wants a store to look at without training.

``simulated_run`` simulates a small synchronous data-parallel job and sends it through the
real stream stages: every rank's components of every step (loss sums and valid tokens, also
by data source; the gradient norm; local step time and the wait in the gradient all-reduce;
peak memory; FLOPs; output |x|max; one-pass tensor statistics on sampled steps) go through
stage 1 (``probewire.stream.reduce.reduce_step``) and stage 2
(``probewire.stream.stage2.RunPipeline``: the P0 view, detectors, anomalies, alerts,
retention). Per-expert token counts are added to the reduced step as stage 1 reduces them.
``write_simulated_run`` stores the rows and promotes the retained detail as the worker does.

The faults are the demo's (``deploy/demo/faults/``: the same classes, names and
parameters, ``parse_fault`` texts included); each simulated one puts the same culprit into
the data that the real fault puts into a training run:

* ``bad-rank``: the rank's batches are random bytes from ``step`` on: its loss is the
  entropy of a uniform byte, ln 256;
* ``easy-batch``: the rank's loss falls to ``loss_scale`` of the others' for ``steps`` steps;
* ``source-regression``: the source's rows become random bytes (a share ``per_step`` more
  of them every step, all at once when 0): its loss moves toward ln 256;
* ``poisoned-batch``: every rank's loss and the gradient norm jump together at ``step``
  (and ``repeat_after`` steps later, when set): a co-spike;
* ``layer-explosion``: from ``layers.<layer>.mlp`` inward the backward maxima, and the
  gradient norm, grow ``scale`` x at ``step``, the loss 1.3 x;
* ``straggler``: the rank's compute takes ``factor`` x as long (or ``delay_s`` more) for
  ``duration`` steps; the other ranks wait for it in the all-reduce, as under DDP;
* ``memory-creep``: the rank's peak memory grows ``mib_per_step`` MiB a step.

    python -m probewire.deploy.demo.simulate --store DIR [--run-id ID]   # write one
"""

from __future__ import annotations

import argparse
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from probewire.instrument.catalog import (
    Comm,
    Grad,
    Label,
    Loss,
    Memory,
    Moe,
    Output,
    System,
    Tensor,
)
from probewire.instrument.wire import RankStep, series_key

from .faults import (
    BadRank,
    EasyBatch,
    Fault,
    LayerExplosion,
    MemoryCreep,
    PoisonedBatch,
    SourceRegression,
    Straggler,
    parse_fault,
)

__all__ = ["SIMULATED", "SimulatedRun", "simulated_run", "write_simulated_run"]

_PARAMS = 1.2e8  # model size behind the 6·N·D FLOP estimate
_RANDOM_BYTES = math.log(256.0)  # loss of a uniform random byte: what a scrambled batch costs
SIMULATED = (
    BadRank,
    EasyBatch,
    SourceRegression,
    PoisonedBatch,
    LayerExplosion,
    Straggler,
    MemoryCreep,
)
"""The demo faults the simulator can put into a run."""


@dataclass(slots=True)
class SimulatedRun:
    """Rows per table as stage 2 produced them, the steps to promote, and a float64
    reference (L, L_max, worst rank) per step computed straight from the rank components."""

    run_id: str
    tables: dict[str, list[dict[str, Any]]]
    promote: list[int] = field(default_factory=list)
    reference: dict[int, tuple[float, float, int]] = field(default_factory=dict)


def _backward_order(layers: int) -> list[str]:
    """Tensors from the output inward."""
    order = ["output"]
    for i in reversed(range(layers)):
        order += [f"layers.{i}.mlp", f"layers.{i}.attn"]
    return order + ["embed"]


def _tensor_parts(
    sigma: float, n: float, world_size: int, rank: int, rng: np.random.Generator
) -> dict[str, float]:
    """One rank's share of the power sums of n draws from N(0, sigma²) (n split evenly)."""
    m = n / world_size
    return {
        Tensor.N: m,
        Tensor.SUM: float(rng.normal(0.0, sigma * math.sqrt(m))),
        Tensor.SUM_SQ: m * sigma * sigma * (1 + 0.01 * float(rng.normal())),
        Tensor.ABS_SUM: m * sigma * math.sqrt(2 / math.pi),
        Tensor.ABS_MAX: 5.0 * sigma * (1 + 0.05 * float(rng.normal())) * (1 - 0.01 * rank),
        Tensor.ZEROS: 0.0,
        Tensor.NONFINITE: 0.0,
        Tensor.SUM3: 0.0,
        Tensor.SUM4: 3.0 * m * sigma**4,
    }


def _faults(faults: Sequence[Fault | str]) -> list[Fault]:
    out = [parse_fault(f) if isinstance(f, str) else f for f in faults]
    for f in out:
        if not isinstance(f, SIMULATED):
            raise ValueError(
                f"{f.name}: the simulator has no model of it; it simulates "
                f"{', '.join(cls.name for cls in SIMULATED)}"
            )
    return out


def _active(fault: Fault, t: int, steps: int = 0) -> bool:
    """The fault acts at step t: from its step on, for ``steps`` steps when given."""
    return t >= fault.step and (not steps or t < fault.step + steps)


F = TypeVar("F", bound=Fault)


@dataclass(slots=True)
class _Step:
    """What every rank of step ``t`` shares: the loss level, the gradient norm, the faults'
    shock (``boost`` of the gradient from ``origin`` inward, ``spike`` of the loss), each
    rank's compute time and when the slowest one finished."""

    t: int
    base: float
    g2: float
    boost: float
    origin: int | None
    spike: float
    compute: np.ndarray
    done: float


def _of(faults: Sequence[Fault], cls: type[F]) -> list[F]:
    """The faults of one kind."""
    return [f for f in faults if isinstance(f, cls)]


def _shared(t: int, faults: Sequence[Fault], world_size: int, rng: np.random.Generator) -> _Step:
    """Step ``t``'s shared state, the layer explosions, poisoned batches and stragglers in it."""
    boost, origin, spike = 1.0, None, 1.0
    for f in _of(faults, LayerExplosion):
        if t == f.step:
            boost, origin, spike = f.scale, f.layer, 1.3
    for p in _of(faults, PoisonedBatch):
        if t == p.step or (p.repeat_after and t == p.step + p.repeat_after):
            boost, spike = boost * 10.0, spike * 1.6
    base = 2.2 + 2.5 * math.exp(-t / 35)
    g2 = (0.5 + 0.4 * math.exp(-t / 30)) * (1 + 0.03 * float(rng.normal())) * boost
    compute = 0.45 * np.exp(rng.normal(0, 0.02, world_size))
    for slow in _of(faults, Straggler):
        if _active(slow, t, slow.duration):
            compute[slow.rank] = (
                compute[slow.rank] * slow.factor
                if slow.factor > 0
                else compute[slow.rank] + slow.delay_s
            )
    done = float(compute.max())  # synchronous DDP: every rank waits for the last one
    return _Step(t, base, g2, boost, origin, spike, compute, done)


def _loss_values(
    step: _Step,
    r: int,
    faults: Sequence[Fault],
    sources: Sequence[tuple[str, float]],
    rng: np.random.Generator,
) -> dict[Any, float]:
    """Rank ``r``'s loss sums and valid tokens, by source and in total."""
    t = step.t
    valid = 4096 - int(rng.integers(0, 256))  # padding varies per rank
    values: dict[Any, float] = {}
    total_sum = total_n = 0.0
    for i, (source, share) in enumerate(sources):
        n = float(round(share * valid))
        mean = step.base * (1 - 0.1 * i) * (1 + 0.01 * float(rng.normal())) * step.spike
        for f in _of(faults, SourceRegression):
            if f.source == source and _active(f, t):
                broken = min(1.0, f.per_step * (t - f.step + 1)) if f.per_step else 1.0
                mean += broken * (_RANDOM_BYTES - mean)
        if any(f.rank == r and _active(f, t) for f in _of(faults, BadRank)):
            mean = _RANDOM_BYTES * (1 + 0.01 * float(rng.normal()))
        for easy in _of(faults, EasyBatch):
            if easy.rank == r and _active(easy, t, easy.steps):
                mean *= easy.loss_scale
        values[series_key(Loss.SUM, {Label.SOURCE: source})] = mean * n
        values[series_key(Loss.TOKENS, {Label.SOURCE: source})] = n
        total_sum, total_n = total_sum + mean * n, total_n + n
    values[series_key(Loss.SUM)] = total_sum
    values[series_key(Loss.TOKENS)] = total_n
    return values


def _system_values(
    step: _Step, r: int, total_n: float, faults: Sequence[Fault], rng: np.random.Generator
) -> dict[Any, float]:
    """Rank ``r``'s gradient norm, step time, all-reduce wait, FLOPs, peak memory, |z|max."""
    t, done = step.t, step.done
    comm = 0.05 * (1 + 0.05 * float(rng.random()))
    creep = sum(
        f.mib_per_step * (1 << 20) * (t - f.step + 1)
        for f in _of(faults, MemoryCreep)
        if f.rank == r and _active(f, t)
    )
    return {
        series_key(Grad.NORM_SQ): step.g2 * step.g2,
        series_key(System.STEP_TIME): done + comm,
        series_key(Comm.WAIT, {Label.OP: "ddp_allreduce"}): done - step.compute[r] + comm,
        series_key(System.FLOPS): 6 * _PARAMS * total_n,
        series_key(Memory.PEAK_ALLOCATED): 20e9
        + r * 1e8
        + t * 2e6
        + 1e6 * float(rng.normal())
        + creep,
        series_key(Output.LOGITS_ABS_MAX): 25.0
        * (1 + 0.05 * float(rng.normal()))
        * math.sqrt(step.boost),
    }


def _tensor_values(
    step: _Step, r: int, layers: int, world_size: int, rng: np.random.Generator
) -> dict[Any, float]:
    """Rank ``r``'s one-pass backward and gradient statistics per tensor (a sampled step)."""
    values: dict[Any, float] = {}
    hit = False  # walking from the output inward: all from the origin on blows up
    for tensor in _backward_order(layers):
        hit = hit or (step.origin is not None and tensor == f"layers.{step.origin}.mlp")
        for kind, sigma in (("bwd", 1e-3), ("grad", 1e-4)):
            parts = _tensor_parts(sigma * (step.boost if hit else 1.0), 1e6, world_size, r, rng)
            for name, v in parts.items():
                values[series_key(name, {Label.TENSOR: tensor, Label.KIND: kind})] = v
    return values


def _reference(records: Sequence[Any]) -> tuple[float, float, int]:
    """(L, L_max, worst rank) in float64, straight from the ranks' loss components."""
    sums = np.array([rec.values[series_key(Loss.SUM)] for rec in records])
    counts = np.array([rec.values[series_key(Loss.TOKENS)] for rec in records])
    means = sums / counts
    return float(sums.sum() / counts.sum()), float(means.max()), int(np.argmax(means))


def _add_expert_loads(
    reduced: Any, layers: int, experts: int, tokens: float, rng: np.random.Generator
) -> None:
    """Per-expert token counts c_i summed over ranks, as stage 1 reduces them."""
    for i in range(layers):
        loads = rng.normal(1.0, 0.05, experts) * tokens * 2 / experts
        for e, c in enumerate(loads):
            labels = {Label.LAYER: str(i), Label.EXPERT: str(e), Label.SHARD: str(e * 2 // experts)}
            reduced.reduced[series_key(Moe.EXPERT_TOKENS, labels)] = c


def _evaluations(run_id: str, t: int, last_row: dict[str, Any]) -> list[dict[str, Any]]:
    """The held-out bpb of step ``t``'s raw and EMA weights, from the last stored loss."""
    return [
        {
            "run_id": run_id,
            "step": t,
            "tokens": last_row["tokens"],
            "flops": last_row["flops"],
            "suite": "heldout",
            "metric": "bpb",
            "value": last_row["loss"] * 1.02 / math.log(2) / 3.8 + shift,
            "weights_stream": stream,
            "reference": reference,
            "n_items": 512,
            "dataset_version": "heldout-v1",
            "tokenizer_version": "tok-v1",
        }
        for stream, reference, shift in (("raw", 1, 0.0), ("ema", 0, -0.01))
    ]


def _store(run: SimulatedRun, out: Any) -> None:
    """Stage 2's rows and per-rank detail columns into the run's tables."""
    from probewire.stream.stage2 import column_rows

    for table, rows in out.rows.items():
        run.tables[table] += rows
    for table, columns in out.columns.items():  # the per-rank detail
        run.tables[table] += column_rows(columns)


def simulated_run(
    run_id: str = "synthetic",
    *,
    steps: int = 120,
    world_size: int = 4,
    layers: int = 4,
    experts: int = 8,
    sources: Sequence[tuple[str, float]] = (("web", 0.8), ("code", 0.15), ("math", 0.05)),
    retain_every: int = 10,
    eval_every: int = 20,
    halo: int = 2,
    detector_window: int = 30,
    faults: Sequence[Fault | str] = (),
    seed: int = 0,
) -> SimulatedRun:
    """Simulate ``steps`` steps of a ``world_size``-rank job with the demo ``faults``."""
    from probewire.stream.records import CompleteReason
    from probewire.stream.reduce import reduce_step
    from probewire.stream.signals import DetectorConfig
    from probewire.stream.stage2 import RunPipeline, Stage2Config

    rng = np.random.default_rng(seed)
    parsed = _faults(faults)
    pipeline = RunPipeline(
        run_id,
        Stage2Config(
            detectors=DetectorConfig(window=detector_window),
            retention_every_k=retain_every,
            retention_halo=halo,
            warmup_steps=halo,
            final_steps=halo,
        ),
    )
    tensor_steps = {t for t in range(steps) if t % retain_every == 0}
    tensor_steps |= {
        s for f in _of(parsed, LayerExplosion) for s in range(f.step - halo, f.step + halo + 1)
    }
    run = SimulatedRun(run_id, defaultdict(list))
    tokens_key = series_key(Loss.TOKENS)
    last_row: dict[str, Any] = {}
    for t in range(steps):
        step = _shared(t, parsed, world_size, rng)
        records = []
        for r in range(world_size):
            values = _loss_values(step, r, parsed, sources, rng)
            values.update(_system_values(step, r, values[tokens_key], parsed, rng))
            if t in tensor_steps:
                values.update(_tensor_values(step, r, layers, world_size, rng))
            records.append(
                RankStep(
                    run_id=run_id,
                    step=t,
                    rank=r,
                    world_size=world_size,
                    host=f"node{r // 8}",
                    coords={"dp": r},
                    values=values,
                )
            )
        run.reference[t] = _reference(records)
        reduced = reduce_step(run_id, t, world_size, records, CompleteReason.ALL_RANKS)
        tokens = float(np.array([rec.values[tokens_key] for rec in records]).sum())
        _add_expert_loads(reduced, layers, experts, tokens, rng)
        out = pipeline.accept(reduced, float(t))
        _store(run, out)
        run.promote += out.promote
        last_row = out.rows["step_metrics"][-1] if out.rows.get("step_metrics") else last_row
        if t % eval_every == 0 and t > 0:
            run.tables["evaluations"] += _evaluations(run_id, t, last_row)
    out = pipeline.finish()
    for table, rows in out.rows.items():
        run.tables[table] += rows
    run.promote = sorted(set(run.promote + out.promote))
    return run


def write_simulated_run(sink: Any, run: SimulatedRun) -> int:
    """Store ``run`` as the worker does: rows, then promotion of the retained detail."""
    from probewire.sinks.retained import promote

    written = sum(sink.write(table, rows) for table, rows in run.tables.items())
    promote(sink, run.run_id, run.promote)
    return written


def _main(argv: Sequence[str] | None = None) -> int:
    from probewire.sinks.clickhouse import ClickHouseSink, connect

    parser = argparse.ArgumentParser(
        prog="python -m probewire.deploy.demo.simulate",
        description="Write a simulated run into a store.",
    )
    parser.add_argument("--store", required=True, help="chdb data directory")
    parser.add_argument("--database", default="probewire")
    parser.add_argument("--run-id", default="demo-synthetic")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--fault",
        action="append",
        metavar="NAME[@STEP][:K=V,...]",
        help="a demo fault (repeatable); default: a source regression at "
        "half the run and a layer explosion at 70%% of it",
    )
    args = parser.parse_args(argv)
    sink = ClickHouseSink(
        connect("chdb:///" + os.path.abspath(args.store).lstrip("/")), args.database
    )
    sink.migrate()
    faults = args.fault or [
        f"source-regression@{args.steps // 2}:source=math,per_step=0.002",
        f"layer-explosion@{int(args.steps * 0.7)}:layer=2,scale=50",
    ]
    run = simulated_run(
        args.run_id, steps=args.steps, retain_every=25, halo=5, detector_window=50, faults=faults
    )
    print(f"wrote {write_simulated_run(sink, run)} rows of run {args.run_id} into {args.store}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
