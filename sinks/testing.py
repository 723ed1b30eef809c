"""A recorded run with known faults, for tests, demos and the docs' first-screen picture.

``recorded_run`` simulates a small data-parallel job and sends it through the real
stream stages: every rank's components of every step (loss sums and valid tokens, also
by data source; the gradient norm; local step time; peak memory; FLOPs; output |x|max;
one-pass tensor statistics on sampled steps) go through stage 1
(``probewire.stream.assemble.reduce_step``) and stage 2
(``probewire.stream.stage2.RunPipeline``: the P0 view, detectors, anomalies, alerts,
retention). Per-expert token counts are added to the reduced step as stage 1 reduces
them (summed over ranks). ``write_recorded_run`` stores the rows and promotes the retained
detail exactly as the worker does. Evaluations are rows as the evaluator publishes them.

Faults put a known culprit into the data: ``BadRank`` (one rank's loss), ``RegressingSource``
(one source's loss drifts up under a flat global curve), ``ExplodingLayer`` (backward
gradients blow up from one layer inward: the gradient norm first, then the loss),
``Straggler`` (one rank's step time).

    python -m probewire.sinks.testing --store DIR [--run-id ID]   # write one into a store
"""

from __future__ import annotations

import argparse
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

__all__ = [
    "BadRank",
    "ExplodingLayer",
    "RecordedRun",
    "RegressingSource",
    "Straggler",
    "recorded_run",
    "write_recorded_run",
]

_PARAMS = 1.2e8          # model size behind the 6·N·D FLOP estimate


@dataclass(frozen=True, slots=True)
class BadRank:
    """From ``from_step`` on, rank ``rank``'s loss is ``factor`` times the others'."""

    rank: int
    from_step: int
    factor: float = 1.5


@dataclass(frozen=True, slots=True)
class RegressingSource:
    """From ``from_step`` on, source ``source``'s loss grows by ``per_step`` (relative) a step."""

    source: str
    from_step: int
    per_step: float = 0.01


@dataclass(frozen=True, slots=True)
class ExplodingLayer:
    """Backward gradients blow up from ``layers.<layer>.mlp`` inward at ``step``.

    One step earlier the gradient norm and the backward maxima already rise (by
    ``factor / 5``); at ``step`` they reach ``factor`` and the loss spikes too.
    """

    layer: int
    step: int
    factor: float = 50.0


@dataclass(frozen=True, slots=True)
class Straggler:
    """From ``from_step`` on, rank ``rank`` takes ``factor`` times as long per step."""

    rank: int
    from_step: int
    factor: float = 2.0


@dataclass(slots=True)
class RecordedRun:
    """Rows per table as stage 2 produced them, the steps to promote, and a float64
    reference (L, L_max, worst rank) per step computed straight from the rank components."""

    run_id: str
    tables: dict[str, list[dict[str, Any]]]
    promote: list[int] = field(default_factory=list)
    reference: dict[int, tuple[float, float, int]] = field(default_factory=dict)


def _backward_order(layers: int) -> list[tuple[str, int]]:
    """Tensors from the output inward, with the layer index each belongs to."""
    order = [("output", layers)]
    for i in reversed(range(layers)):
        order += [(f"layers.{i}.mlp", i), (f"layers.{i}.attn", i)]
    return order + [("embed", -1)]


def _tensor_parts(sigma: float, n: float, world_size: int, rank: int,
                  rng: np.random.Generator) -> dict[str, float]:
    """One rank's share of the power sums of n draws from N(0, sigma²) (n split evenly)."""
    m = n / world_size
    return {"n": m, "sum": float(rng.normal(0.0, sigma * math.sqrt(m))),
            "sum_sq": m * sigma * sigma * (1 + 0.01 * float(rng.normal())),
            "abs_sum": m * sigma * math.sqrt(2 / math.pi),
            "abs_max": 5.0 * sigma * (1 + 0.05 * float(rng.normal())) * (1 - 0.01 * rank),
            "zeros": 0.0, "nonfinite": 0.0, "sum3": 0.0, "sum4": 3.0 * m * sigma ** 4}


def recorded_run(run_id: str = "synthetic", *, steps: int = 120, world_size: int = 4,
                 layers: int = 4, experts: int = 8,
                 sources: Sequence[tuple[str, float]] = (("web", 0.8), ("code", 0.15),
                                                         ("math", 0.05)),
                 retain_every: int = 10, eval_every: int = 20, halo: int = 2,
                 detector_window: int = 30, faults: Sequence[object] = (),
                 seed: int = 0) -> RecordedRun:
    """Simulate ``steps`` steps of a ``world_size``-rank job with ``faults`` injected."""
    from probewire.stream.assemble import reduce_step
    from probewire.instrument.wire import RankStep, series_key
    from probewire.stream.signals import DetectorConfig
    from probewire.stream.stage2 import RunPipeline, Stage2Config

    rng = np.random.default_rng(seed)
    bad = [f for f in faults if isinstance(f, BadRank)]
    regress = [f for f in faults if isinstance(f, RegressingSource)]
    explode = [f for f in faults if isinstance(f, ExplodingLayer)]
    slow = [f for f in faults if isinstance(f, Straggler)]
    pipeline = RunPipeline(run_id, Stage2Config(
        detectors=DetectorConfig(window=detector_window), retention_every_k=retain_every,
        retention_halo=halo, warmup_steps=halo, final_steps=halo))
    tensor_steps = {t for t in range(steps) if t % retain_every == 0}
    tensor_steps |= {s for f in explode for s in range(f.step - halo, f.step + halo + 1)}
    tables: dict[str, list[dict[str, Any]]] = defaultdict(list)
    run = RecordedRun(run_id, tables)
    last_row: dict[int, dict[str, Any]] = {}

    for t in range(steps):
        boost, origin = 1.0, None
        for f in explode:
            if t in (f.step - 1, f.step):
                boost, origin = (f.factor if t == f.step else f.factor / 5), f.layer
        loss_spike = 1.3 if any(t == f.step for f in explode) else 1.0
        base = 2.2 + 2.5 * math.exp(-t / 35)
        g2 = (0.5 + 0.4 * math.exp(-t / 30)) * (1 + 0.03 * float(rng.normal())) * boost
        records = []
        for r in range(world_size):
            valid = 4096 - int(rng.integers(0, 256))  # padding varies per rank
            values: dict[Any, float] = {}
            total_sum = total_n = 0.0
            for i, (source, share) in enumerate(sources):
                n = float(round(share * valid))
                mean = base * (1 - 0.1 * i) * (1 + 0.01 * float(rng.normal())) * loss_spike
                mean *= math.prod(f.factor for f in bad if f.rank == r and t >= f.from_step)
                mean *= math.prod(1 + f.per_step * (t - f.from_step) for f in regress
                                  if f.source == source and t >= f.from_step)
                values[series_key("loss.sum", {"source": source})] = mean * n
                values[series_key("loss.tokens", {"source": source})] = n
                total_sum, total_n = total_sum + mean * n, total_n + n
            tau = 0.5 * (1 + 0.02 * float(rng.normal()))
            tau *= math.prod(f.factor for f in slow if f.rank == r and t >= f.from_step)
            values.update({
                series_key("loss.sum"): total_sum, series_key("loss.tokens"): total_n,
                series_key("grad.norm_sq"): g2 * g2, series_key("step_time_s"): tau,
                series_key("flops.step"): 6 * _PARAMS * total_n,
                series_key("memory.peak_allocated_bytes"):
                    20e9 + r * 1e8 + t * 2e6 + 1e6 * float(rng.normal()),
                series_key("output.logits_abs_max"):
                    25.0 * (1 + 0.05 * float(rng.normal())) * math.sqrt(boost)})
            if t in tensor_steps:
                hit = False  # walking from the output inward: all from the origin on blows up
                for tensor, _index in _backward_order(layers):
                    hit = hit or (origin is not None and tensor == f"layers.{origin}.mlp")
                    for kind, sigma in (("bwd", 1e-3), ("grad", 1e-4)):
                        parts = _tensor_parts(sigma * (boost if hit else 1.0), 1e6, world_size,
                                              r, rng)
                        for name, v in parts.items():
                            values[series_key(f"tensor.{name}",
                                              {"tensor": tensor, "kind": kind})] = v
            records.append(RankStep(run_id=run_id, step=t, rank=r, world_size=world_size,
                                    host=f"node{r // 8}", coords={"dp": r}, values=values))
        sums = np.array([rec.values[series_key("loss.sum")] for rec in records])
        counts = np.array([rec.values[series_key("loss.tokens")] for rec in records])
        means = sums / counts
        run.reference[t] = (float(sums.sum() / counts.sum()), float(means.max()),
                            int(np.argmax(means)))
        reduced = reduce_step(run_id, t, world_size, records, "all_ranks")
        for i in range(layers):  # c_i summed over ranks, as stage 1 reduces it
            loads = rng.normal(1.0, 0.05, experts) * float(counts.sum()) * 2 / experts
            for e, c in enumerate(loads):
                reduced.reduced[series_key("moe.expert_tokens", {
                    "layer": str(i), "expert": str(e), "shard": str(e * 2 // experts)})] = c
        out = pipeline.accept(reduced, float(t))
        for table, rows in out.rows.items():
            tables[table] += rows
        run.promote += out.promote
        last_row = out.rows["step_metrics"][-1] if out.rows.get("step_metrics") else last_row
        if t % eval_every == 0 and t > 0:
            for stream, reference, shift in (("raw", 1, 0.0), ("ema", 0, -0.01)):
                tables["evaluations"].append({
                    "run_id": run_id, "step": t, "tokens": last_row["tokens"],
                    "flops": last_row["flops"], "suite": "heldout", "metric": "bpb",
                    "value": last_row["loss"] * 1.02 / math.log(2) / 3.8 + shift,
                    "weights_stream": stream, "reference": reference, "n_items": 512,
                    "dataset_version": "heldout-v1", "tokenizer_version": "tok-v1"})
    out = pipeline.finish()
    for table, rows in out.rows.items():
        tables[table] += rows
    run.promote = sorted(set(run.promote + out.promote))
    return run


def write_recorded_run(sink: Any, run: RecordedRun) -> int:
    """Store ``run`` as the worker does: rows, then promotion of the retained detail."""
    from .retained import promote

    written = sum(sink.write(table, rows) for table, rows in run.tables.items())
    promote(sink, run.run_id, run.promote)
    return written


def _main(argv: Sequence[str] | None = None) -> int:
    from .clickhouse import ClickHouseSink, connect

    parser = argparse.ArgumentParser(prog="python -m probewire.sinks.testing",
                                     description="Write a recorded synthetic run into a store.")
    parser.add_argument("--store", required=True, help="chdb data directory")
    parser.add_argument("--database", default="probewire")
    parser.add_argument("--run-id", default="demo-synthetic")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    sink = ClickHouseSink(connect("chdb:///" + os.path.abspath(args.store).lstrip("/")),
                          args.database)
    sink.migrate()
    run = recorded_run(args.run_id, steps=args.steps, retain_every=25, halo=5,
                       detector_window=50,
                       faults=(RegressingSource("math", args.steps // 2, 0.002),
                               ExplodingLayer(2, int(args.steps * 0.7))))
    print(f"wrote {write_recorded_run(sink, run)} rows of run {args.run_id} into {args.store}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
