"""Simulated training ranks for tests and benchmarks of the stream (no torch needed).

``SimRun`` decides every rank's components for every step from a seed, with the edge
cases the seeds name: uneven valid-token counts, a rank with no valid token, ranks that
miss steps, an injected co-spike; and, for the detectors, synchronous DDP timing (a
straggler, a host-wide bursty load), a persistent shift of one rank's loss, the
loop's own clipping norm (global, or only each rank's local shard), residual branches
whose R_b jumps, gradient groups whose G_max collapses, and held-out BPB evaluations. ``send`` publishes them as real OTLP messages through
the same emitter the ranks use; ``expected`` gives the float64 reference for L and L_max.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from probewire.instrument.catalog import Comm, Grad, Group, Label, Loss, Net, Residual, System
from probewire.instrument.export import KafkaTransport, StepEmitter
from probewire.instrument.plumbing import TopicConfig
from probewire.instrument.wire import Point, RankIdentity

__all__ = ["RANKS_PER_NODE", "SimRun", "own_topics", "send", "stage2_in_process"]

RANKS_PER_NODE = 4  # the simulated hosts: ranks 0-3 on node0, 4-7 on node1, ...


@dataclass(slots=True, kw_only=True)
class SimRun:
    run_id: str
    world_size: int = 8
    steps: int = 80
    seed: int = 0
    missing: dict[int, set[int]] = field(default_factory=dict)  # step -> ranks that stay silent
    empty: set[tuple[int, int]] = field(default_factory=set)  # (step, rank) with 0 tokens
    cospike_step: int | None = None
    clip_threshold: float | None = None  # c every rank clips at (grad.clip_threshold), if any
    clip_other: dict[tuple[int, int], float] = field(default_factory=dict)  # (step, rank) -> c
    net: bool = False  # each node's local rank 0 (``send``: 4 ranks a node) sends net.rx/tx
    ddp: bool = False  # DDP timing: every rank waits for the slowest in the all-reduce
    slow: tuple[int, int, int, float] | None = None  # (rank, from step, steps, factor)
    burner: bool = False  # host-wide load: every rank 1.3x, and 2x in random bursts
    shift: tuple[int, int, float] | None = None  # (rank, from step, factor on its loss)
    clip_norm: str | None = None  # "global": the loop reports G2; "local": its shard's
    residual: tuple[int, float] | None = None  # (from step, factor on layer 1 mlp's R_b):
    #                                             every rank sends two branches' R_b
    vanish: tuple[int, float] | None = None  # (from step, factor on group other's G_max):
    #                                           every rank sends its gradient groups
    bpb: tuple[int, float] | None = None  # (from step, factor): ``stage2_in_process`` feeds
    #                                        a held-out BPB evaluation every 50 steps

    def components(self, step: int, rank: int) -> dict[str, float] | None:
        """(loss sum, valid tokens, grad norm², step time; with a clip threshold c, c and
        grad.clipped = 1[G2 > c]; with ``net``, a node's local rank 0 sends its network
        bytes) of one rank, or None if silent."""
        if rank in self.missing.get(step, set()):
            return None
        rng = np.random.default_rng([self.seed, step, rank])
        tokens = 0 if (step, rank) in self.empty else int(rng.integers(100, 2000))
        mean_loss = 3.0 * math.exp(-step / 400) * math.exp(rng.normal(0, 0.01))
        grad = 0.5 * math.exp(np.random.default_rng([self.seed, step]).normal(0, 0.05))
        if step == self.cospike_step:
            mean_loss *= 3.0
            grad *= 20.0
        if self.shift is not None and rank == self.shift[0] and step >= self.shift[1]:
            mean_loss *= self.shift[2]
        parts = {
            Loss.SUM: mean_loss * tokens,
            Loss.TOKENS: float(tokens),
            Grad.NORM_SQ: grad * grad,
            System.STEP_TIME: 0.1 + 0.001 * rank,
        }
        c = self.clip_other.get((step, rank), self.clip_threshold)
        if c is not None:  # as the rank's s.clip_grad_norm_(params, c) reports it
            parts[Grad.CLIP_THRESHOLD] = c
            parts[Grad.CLIPPED] = float(grad > c)
        if self.net and rank % RANKS_PER_NODE == 0:
            parts[Net.RX], parts[Net.TX] = (float(n) for n in rng.integers(1, 10**9, 2))
        if self.clip_norm is not None:  # each rank owns a shard of squared sum grad²: the
            # global norm is grad sqrt(ranks), the shard's own grad
            share = math.sqrt(self.world_size) if self.clip_norm == "global" else 1.0
            parts[Grad.CLIP_NORM] = grad * share
        if self.ddp:
            parts[System.STEP_TIME], _ = self.timing(step, rank)
        return parts

    def timing(self, step: int, rank: int) -> tuple[float, float]:
        """(step time, all-reduce wait) of one rank under synchronous DDP: each rank computes
        for ~0.1 s (the straggler ``factor`` x, a loaded host 1.3x and 2x in bursts), then
        waits for the slowest one; the wait is its exposed collective time."""
        rng = np.random.default_rng([self.seed, step, 10_000])
        compute = 0.1 * np.exp(rng.normal(0, 0.02, self.world_size))
        if self.burner:
            compute *= 1.3 * np.where(rng.random(self.world_size) < 0.3, 2.0, 1.0)
        if self.slow is not None:
            r, first, steps, factor = self.slow
            if first <= step < first + steps:
                compute[r] *= factor
        done, comm = float(compute.max()), 0.01
        return done + comm, done - float(compute[rank]) + comm

    def points(self, step: int, rank: int) -> list[Point] | None:
        """The rank's points of one step (``components``, and the all-reduce wait under
        DDP timing), or None if silent."""
        parts = self.components(step, rank)
        if parts is None:
            return None
        points = [Point(name, value) for name, value in parts.items()] + self._parts(step, rank)
        if self.ddp:
            wait = self.timing(step, rank)[1]
            points.append(Point(Comm.WAIT, wait, ((Label.OP, "ddp_allreduce"),)))
        return points

    def _parts(self, step: int, rank: int) -> list[Point]:
        """The labelled per-part points: residual branches (``residual``: R_b 0.5 and 2.0,
        layer 1 mlp's x factor from its step) and gradient groups (``vanish``: G_max
        0.01 and 0.1, group other's x factor from its step), 100 tokens / elements each."""
        rng = np.random.default_rng([self.seed, step, rank, 7])
        out: list[Point] = []
        if self.residual is not None:
            for layer, branch, ratio in (("0", "attn", 0.5), ("1", "mlp", 2.0)):
                if layer == "1" and step >= self.residual[0]:
                    ratio *= self.residual[1]
                where = ((Label.LAYER, layer), (Label.BRANCH, branch))
                ratio *= math.exp(rng.normal(0, 0.05))
                out += [
                    Point(Residual.TOKENS, 100.0, where),
                    Point(Residual.name("ratio", "sum"), 100.0 * ratio, where),
                    Point(Residual.name("stream_norm", "sum"), 100.0, where),
                    Point(Residual.name("branch_norm", "sum"), 100.0 * ratio, where),
                ]
        if self.vanish is not None:
            for group, gmax in (("embedding", 0.01), ("other", 0.1)):
                if group == "other" and step >= self.vanish[0]:
                    gmax *= self.vanish[1]
                gmax *= math.exp(rng.normal(0, 0.1))
                labels = ((Label.GROUP, group),)
                out += [
                    Point(Grad.ABS_SUM, 100.0 * gmax / 10, labels),
                    Point(Grad.ABS_MAX, gmax, labels),
                    Point(Grad.ZEROS, 0.0, labels),
                    Point(Grad.ELEMENTS, 100.0, labels),
                ]
        return out

    def evaluation(self, step: int) -> dict[str, Any] | None:
        """The held-out BPB evaluation row of ``step`` (every 50 steps with ``bpb``): 1 +
        0.5 exp(-step / 400), x factor from its step."""
        if self.bpb is None or step % 50:
            return None
        value = 1.0 + 0.5 * math.exp(-step / 400)
        if step >= self.bpb[0]:
            value *= self.bpb[1]
        return {
            "run_id": self.run_id,
            "step": step,
            "suite": "heldout",
            "metric": "bpb",
            "value": value,
            "reference": 1,
        }

    def expected(self, step: int) -> tuple[float, float]:
        """float64 reference: L = Σ sums / Σ counts; L_max = max of rank means (count > 0)."""
        parts = [c for r in range(self.world_size) if (c := self.components(step, r)) is not None]
        sums = np.array([c[Loss.SUM] for c in parts], dtype=np.float64)
        counts = np.array([c[Loss.TOKENS] for c in parts], dtype=np.float64)
        valid = counts > 0
        return float(sums.sum() / counts.sum()), float(np.max(sums[valid] / counts[valid]))


def stage2_in_process(run: SimRun, config: Any) -> dict[str, list[dict[str, Any]]]:
    """``run`` through stage 1's reduction and stage 2 (``config``: a ``Stage2Config``) in
    this process, no broker: the rows stage 2 produced, by table (a benchmark's or a unit
    test's quick path; the integration tests send through the broker)."""
    from probewire.instrument.wire import RankStep, series_key

    from .records import CompleteReason
    from .reduce import reduce_step
    from .stage2 import RunPipeline

    pipeline = RunPipeline(run.run_id, config)
    rows: dict[str, list[dict[str, Any]]] = {}
    for step in range(run.steps):
        records = [
            RankStep(
                run_id=run.run_id,
                step=step,
                rank=r,
                world_size=run.world_size,
                host="h",
                coords={"dp": r},
                values={series_key(p.name, p.labels): p.value for p in run.points(step, r) or ()},
            )
            for r in range(run.world_size)
        ]
        reduced = reduce_step(run.run_id, step, run.world_size, records, CompleteReason.ALL_RANKS)
        out = pipeline.accept(reduced, float(step))
        evaluation = run.evaluation(step)
        if evaluation is not None:
            out.extend(pipeline.on_evaluations([evaluation]))
        for table, got in out.rows.items():
            rows.setdefault(table, []).extend(got)
    return rows


def send(
    run: SimRun,
    bootstrap: str,
    topic: str,
    steps: Iterable[int],
    duplicates: Iterable[tuple[int, int]] = (),
    block_ranks: int = 256,
) -> int:
    """Publish the given steps for every rank (plus re-sent duplicates); returns messages.
    ``block_ranks``: the ranks' fan-in block (``ProbeConfig.block_ranks``)."""
    transports = [
        KafkaTransport({"bootstrap.servers": bootstrap}, topic) for _ in range(run.world_size)
    ]
    emitters = [
        StepEmitter(
            RankIdentity(
                run_id=run.run_id,
                rank=r,
                world_size=run.world_size,
                host=f"node{r // RANKS_PER_NODE}",
                coords={Group.DATA.value: r},
            ),
            transports[r],
            block_ranks=block_ranks,
        )
        for r in range(run.world_size)
    ]
    sent, dup = 0, set(duplicates)
    for step in steps:
        for rank in range(run.world_size):
            points = run.points(step, rank)
            if points is None:
                continue
            for _ in range(2 if (step, rank) in dup else 1):
                emitters[rank].emit(step, points)
                sent += 1
    for emitter in emitters:
        emitter.close()
    return sent


def own_topics(tag: str, partitions: int = 4) -> TopicConfig:
    """Every topic name suffixed with ``tag``: a stack on a broker other tests share (one
    per test session) reads none of their messages, dead letters or steps."""
    default = TopicConfig()
    names = {
        f.name: f"{getattr(default, f.name)}.{tag}"
        for f in dataclasses.fields(default)
        if f.type in (str, "str")
    }
    return TopicConfig(**names, partitions=partitions)
