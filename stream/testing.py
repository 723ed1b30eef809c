"""Simulated training ranks for tests and benchmarks of the stream (no torch needed).

``SimRun`` decides every rank's components for every step from a seed, with the edge
cases the seeds name: uneven valid-token counts, a rank with no valid token, ranks that
miss steps, an injected co-spike. ``send`` publishes them as real OTLP messages through
the same emitter the ranks use; ``expected`` gives the float64 reference for L and L_max.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from probewire.instrument.catalog import Grad, Group, Loss, Net, System
from probewire.instrument.export import KafkaTransport, StepEmitter
from probewire.instrument.plumbing import TopicConfig
from probewire.instrument.wire import Point, RankIdentity

__all__ = ["RANKS_PER_NODE", "SimRun", "own_topics", "send"]

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
        return parts

    def expected(self, step: int) -> tuple[float, float]:
        """float64 reference: L = Σ sums / Σ counts; L_max = max of rank means (count > 0)."""
        parts = [c for r in range(self.world_size) if (c := self.components(step, r)) is not None]
        sums = np.array([c[Loss.SUM] for c in parts], dtype=np.float64)
        counts = np.array([c[Loss.TOKENS] for c in parts], dtype=np.float64)
        valid = counts > 0
        return float(sums.sum() / counts.sum()), float(np.max(sums[valid] / counts[valid]))


def send(
    run: SimRun,
    bootstrap: str,
    topic: str,
    steps: Iterable[int],
    duplicates: Iterable[tuple[int, int]] = (),
) -> int:
    """Publish the given steps for every rank (plus re-sent duplicates); returns messages."""
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
        )
        for r in range(run.world_size)
    ]
    sent, dup = 0, set(duplicates)
    for step in steps:
        for rank in range(run.world_size):
            parts = run.components(step, rank)
            if parts is None:
                continue
            points = [Point(name, value) for name, value in parts.items()]
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
