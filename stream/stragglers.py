"""The straggler rules of ``signals``: one rank's own-time ratio rho_r (its own time, step
time minus its exposed collective wait, over the other ranks' median) against its own
history; the rank a whole-job step-time rise is carried by. Pure and serialisable."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from .detect import RankLevels
from .findings import Category, DetectorConfig, Finding
from .shifts import PeerShift

__all__ = ["PACE_RATIO", "StragglerRules"]

PACE_RATIO = 1.2
"""A step-time spike names the rank whose own-time ratio held at least this far above its
baseline over the spike's steps (one rank 1.2x the others' pace); else the whole job."""


class StragglerRules:
    """The per-rank levels and CUSUMs of one run, and the job's step time over its baseline
    on the last ``straggler_steps`` steps (the gross tier's guard)."""

    def __init__(self, config: DetectorConfig, state: Mapping[str, Any] | None = None) -> None:
        self.config = config
        cfg = config
        self.levels = RankLevels(
            window=cfg.window,
            recent=max(cfg.straggler_steps, cfg.straggler_held_steps, cfg.straggler_recent_steps),
        )
        self.slow = PeerShift(
            window=cfg.window,
            min_history=min(cfg.shift_history, cfg.window),
            k=cfg.straggler_cusum_k,
            cap=cfg.straggler_cusum_cap,
            h=cfg.straggler_cusum_h,
            min_scale=cfg.straggler_cusum_scale,
            floor=1.0,
        )
        self.job: deque[tuple[int, float]] = deque(maxlen=cfg.straggler_steps)
        state = state or {}
        # absent in states saved before the guard: its steps count as unmeasured
        self.job.extend((int(s), float(v)) for s, v in state.get("straggler_job", ()))
        if "levels" in state:
            self.levels = RankLevels.from_state(state["levels"])
        if "slow" in state:  # absent in states saved before the CUSUMs
            self.slow = PeerShift.from_state(state["slow"])

    def observe(
        self, step: int, ratios: Mapping[int, float], job: float | None = None
    ) -> list[Finding]:
        """`step_time` pages when one rank's own-time ratio rho_r (its own time, step time
        minus its exposed collective wait, over the other ranks' median: load the whole
        host shares cancels) stands above that rank's own baseline (its history, at least
        parity):

        * with 3 or more ranks, when its CUSUM (``shifts.PeerShift``: min(x / s, cap) - k a
          step on x = log rho_r - its baseline, reset at parity) reaches h: a rank 1.3x
          slower than steady peers pages on its 6th slow step; on the shared 2-core host
          (a healthy rank's ratio moves 15-20 % a step) a recorded 1.5x rank on its 13th
          (the held rule: +33) and a 1.3x one not at all, while healthy runs and a CPU
          burner's peaked at S 5-8 (``tests/unit/stream/data/gloo_own_ratios.json`` and
          an e2e run, where k 0.75 / h 8 paged a healthy rank); bursts the ranks share
          widen the scale s (the peers' joint spread of the last steps);

        * by ``straggler_ratio`` on each of ``straggler_steps`` consecutive steps, the job's
          step time being at least ``straggler_job_slowdown`` x its baseline on each of them
          where measured: a gross straggler, seen in a few steps. A real one costs the job
          time: under synchronous DDP its extra own time lands on the critical path (the
          others do their usual work, then wait), and its own time is at least
          ``derive.OWN_FLOOR`` (5 %) of the step, so a rank at 5x its usual ratio adds at
          least (5 - 1) x 5 % of the step: 1.2x, the default (the demo's 1-3 s sleep on ~40 ms
          steps, 25-75x). With two ranks each is the other's whole reference, and the ratio
          also explodes when the other's own time collapses: on the loaded host the other
          rank's exposed wait covered nearly its whole step (its own time at the 5 % floor)
          and rho held 18.7-20.8 on three steps in a row while the step time was
          1.72x, 0.98x and 1.45x its median (a healthy 2-rank moe run paged; recorded in
          ``tests/unit/stream/data/gloo_2rank_steps.json``);
        * with 3 or more ranks, at its ``straggler_held_quantile`` over the last
          ``straggler_held_steps`` steps by ``straggler_held_ratio``: the rank was slower
          than the others on nine steps in ten of 40 (a sign test more than a size test).
          A rank 1.5x slower holds rho = 1.5 on every step; a rank the scheduler of a
          loaded host slows is slow in bursts and fast in between. With two ranks the
          other rank is the whole reference and the rule is off.

        Measured on the shared 2-core host (load average ~10): over 2,000-5,000 healthy
        steps of 3 gloo ranks, with and without a CPU burner, the held level (q 0.1 of 40
        steps) peaked at 0.96, while the median over 40 steps reached 2.0 and the lower
        quartile 1.3; a rank slowed by half its step held 1.13-1.41 (2 ranks: 1.25 on a
        healthy 5,000-step run, hence the 3-rank condition).

        ``job`` is the step's step time over its own baseline (the median of its history,
        ``signals``), None when either is unknown."""
        self.levels.update(step, ratios)
        if job is not None and math.isfinite(job):
            self.job.append((step, job))
        slow = [r for r in self.slow.update(ratios) if r.shift]
        if slow:  # the CUSUM: the rank that moved furthest above its baseline
            res = max(slow, key=lambda r: (r.ratio / r.baseline, -r.key))
            return [
                Finding(
                    signal="step_time",
                    kind="straggler",
                    value=res.ratio,
                    baseline=res.baseline,
                    z=math.log(res.ratio / res.baseline) / res.scale,
                    category=Category.TIME,
                    page=True,
                    culprit=f"rank {res.key}",
                    ranks=[res.key],
                )
            ]
        return self._held(step, ratios)

    def _job_slowed(self, step: int) -> bool:
        """The job's step time was at least ``straggler_job_slowdown`` x its baseline on each
        of the last ``straggler_steps`` steps that measured it (an unmeasured step, such as
        the window's warm-up, does not count against)."""
        cfg = self.config
        first = step - cfg.straggler_steps + 1
        return all(v >= cfg.straggler_job_slowdown for s, v in self.job if first <= s <= step)

    def _held(self, step: int, ratios: Mapping[int, float]) -> list[Finding]:
        """The held rules of ``_straggler``: the rank furthest over its threshold, if any."""
        cfg = self.config
        tiers: list[tuple[int, float, float]] = []
        if self._job_slowed(step):
            tiers.append((cfg.straggler_steps, 0.0, cfg.straggler_ratio))
        if len(ratios) >= 3:
            tiers += [
                (cfg.straggler_held_steps, cfg.straggler_held_quantile, cfg.straggler_held_ratio),
                (
                    cfg.straggler_recent_steps,
                    cfg.straggler_recent_quantile,
                    cfg.straggler_recent_ratio,
                ),
            ]
        best: tuple[float, int, float] | None = None  # (level / threshold, rank, level)
        for rank in sorted(ratios):
            for steps, q, threshold in tiers:
                level = self.levels.held(rank, steps, q)
                if (
                    level is not None
                    and level >= threshold
                    and (best is None or level / threshold > best[0])
                ):
                    best = (level / threshold, rank, level)
        if best is None:
            return []
        _, rank, level = best
        base = self.levels.baseline(rank)
        if base is None:  # held above its own baseline: it has one
            return []
        return [
            Finding(
                signal="step_time",
                kind="straggler",
                value=level * base,
                baseline=base,
                z=None,
                category=Category.TIME,
                page=True,
                culprit=f"rank {rank}",
                ranks=[rank],
            )
        ]

    def pace_setter(self) -> int | None:
        """The rank whose own-time ratio held highest above its baseline over the last
        ``straggler_steps`` steps (its long baseline, or early in a run its CUSUM's), when
        that is at least ``PACE_RATIO``: the rank a step-time rise is carried by; None when
        the whole job slowed together."""
        steps = self.config.straggler_steps
        best: tuple[float, int] | None = None
        for rank in self.levels.ranks:
            level = self.levels.held(rank, steps, 0.0)
            early = self.slow.held(rank, steps)
            for value in (level, early):
                if value is not None and (best is None or value > best[0]):
                    best = (value, rank)
        return best[1] if best is not None and best[0] >= PACE_RATIO else None

    def to_state(self) -> dict[str, Any]:
        return {
            "levels": self.levels.to_state(),
            "slow": self.slow.to_state(),
            "straggler_job": [[s, v] for s, v in self.job],
        }
