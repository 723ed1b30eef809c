"""P0 signals: which per-step values page, how each is detected, what to open next.

Every rule reads one value of the step's P0 view and runs one detector on it:
a robust spike detector on log(x + ε) (seeds 001 §4), a threshold, or a drift test
against the run's own post-warm-up baseline. Step time has two rules under one signal:
the spike rule, and a straggler rule (the same rank's own-time ratio,
straggler_own_ratio, at or over a threshold for a few consecutive steps). Findings carry their escalation category
(job state → loss → gradient norm and spikes → step time → memory → expert balance, then
layer views; seeds 001 §1), so an alert says what to open next. An alert for a signal
is raised once per episode: it re-arms after ``rearm_steps`` quiet steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from .detect import ClipRateWindow, CoSpikeTracker, RobustSpikeDetector, SpikeResult

__all__ = ["Category", "DetectorConfig", "Finding", "SignalDetectors", "next_steps"]


class Category(IntEnum):
    """The escalation order of seeds 001 §1, then the layer-level views."""

    JOB = 0
    LOSS = 1
    GRAD = 2
    TIME = 3
    MEMORY = 4
    EXPERTS = 5
    LAYERS = 6


_WHAT_TO_OPEN = {
    Category.JOB: "job state: ranks_missing / late data in step_metrics and rank_metrics",
    Category.LOSS: "loss: loss_worst_rank and its rank, loss_by_source against each source's "
                   "own history",
    Category.GRAD: "gradient norm and spikes: grad_norm, loss_z/grad_z, clip_rate, co-spikes",
    Category.TIME: "step time: step_time_s per rank, straggler_score and straggler_own_ratio, "
                   "exposed collective wait",
    Category.MEMORY: "memory: peak_memory_bytes per rank and its growth",
    Category.EXPERTS: "expert balance: moe_maxvio, H_norm and per-expert load in expert_stats",
    Category.LAYERS: "layer views: tensor_view backward abs max walking inward from the output",
}


def next_steps(category: Category) -> list[str]:
    """What to open next, in escalation order, starting at the category that moved."""
    return [_WHAT_TO_OPEN[c] for c in Category if c >= category]


@dataclass(slots=True, kw_only=True)
class Finding:
    """One anomaly at one step; ``page`` marks the P0 conditions that become alerts."""

    signal: str
    kind: str                 # spike | cospike | nonfinite | threshold | drift | straggler
    value: float
    baseline: float | None
    z: float | None
    category: Category
    page: bool
    culprit: str = ""         # "rank 3", "source code", "layer 2", ...
    ranks: list[int] = field(default_factory=list)


@dataclass(kw_only=True, slots=True)
class DetectorConfig:
    """Thresholds are configuration; ``probewire calibrate`` derives z thresholds."""

    window: int = 100
    loss_z: float = 6.0
    grad_z: float = 6.0
    signal_z: float = 8.0            # single-signal pages (worst rank, source, step time...)
    straggler_ratio: float = 5.0     # one rank's own time over the others' median own time...
    straggler_steps: int = 3         # ...this many consecutive steps, the same rank: a page
    clip_threshold: float = 1.0
    clip_window: int = 100
    memory_growth: float = 0.2       # page when peak memory exceeds its baseline by 20%
    maxvio_threshold: float = 2.0    # busiest expert carries 3x the mean load
    maxvio_steps: int = 3            # ... on this many consecutive steps after warm-up
    media_scale_min: float = 0.1     # γ below this: media the backbone can ignore
    residual_ratio_min: float = 2.0 ** -8  # R_b below bf16's relative precision: swallowed
    rearm_steps: int = 50


def _spike_finding(signal: str, res: SpikeResult, category: Category, page: bool,
                   culprit: str = "", ranks: list[int] | None = None) -> Finding | None:
    if not res.spike or (res.direction is not None and res.direction < 0 and not res.nonfinite):
        return None
    baseline = None if res.median is None else math.exp(res.median)
    return Finding(signal=signal, kind="nonfinite" if res.nonfinite else "spike",
                   value=res.x, baseline=baseline, z=res.z, category=category, page=page,
                   culprit=culprit, ranks=ranks or [])


class SignalDetectors:
    """All per-run detector state; serialisable with ``to_state``/``from_state``."""

    _SPIKE_SIGNALS = ("loss", "grad_norm", "worst_rank_ratio", "step_time", "output_absmax")

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        w = config.window
        self.spikes = {
            "loss": RobustSpikeDetector(window=w, threshold=config.loss_z),
            "grad_norm": RobustSpikeDetector(window=w, threshold=config.grad_z),
            **{name: RobustSpikeDetector(window=w, threshold=config.signal_z)
               for name in self._SPIKE_SIGNALS[2:]},
        }
        self.sources: dict[str, RobustSpikeDetector] = {}
        self.cospikes = CoSpikeTracker()
        self.clip = ClipRateWindow(window=config.clip_window, threshold_c=config.clip_threshold)
        self.memory_baseline: float | None = None
        self.memory_seen: list[float] = []
        self.maxvio_run = 0  # consecutive measured steps with MaxVio above its threshold
        self.missing_run: dict[int, int] = {}  # rank -> consecutive steps it was missing
        self.last_page: dict[str, int] = {}
        self.straggler_run: list[int | None] = [None, 0, None]  # rank, consecutive steps, last

    # -- one step ---------------------------------------------------------------------------
    def observe(self, step: int, view: dict[str, Any], sources: dict[str, float]) -> tuple[
            dict[str, Any], list[Finding]]:
        """Update every detector with one step's P0 view; return derived fields and findings.

        ``sources`` maps each data source to its loss relative to the global loss,
        L_source / L; the worst rank is scored the same way, as L_max / L."""
        cfg, found = self.config, []
        derived: dict[str, Any] = {}
        loss = self.spikes["loss"].update(view["loss"]) if view["loss"] is not None else None
        grad = self.spikes["grad_norm"].update(view["grad_norm"]) \
            if view["grad_norm"] is not None else None
        derived["loss_z"] = None if loss is None else loss.z
        derived["grad_z"] = None if grad is None else grad.z
        derived["loss_spike"] = int(bool(loss and loss.spike))
        derived["grad_spike"] = int(bool(grad and grad.spike))
        derived["warmup"] = int(bool(loss is None or loss.warmup))
        for res, name in ((loss, "loss"), (grad, "grad_norm")):
            if res is not None and res.nonfinite:
                found.append(Finding(signal=name, kind="nonfinite", value=res.x, baseline=None,
                                     z=None, category=Category.LOSS if name == "loss"
                                     else Category.GRAD, page=True))
            elif res is not None and res.spike:
                found.append(_spike_finding(name, res, Category.GRAD, page=False))
        if loss is not None and grad is not None:
            co = self.cospikes.update(loss, grad)
            derived.update(cospike=int(co.co_spike), cospike_count=co.count,
                           cospike_magnitude=co.cumulative_magnitude)
            if co.co_spike and not co.nonfinite:
                found.append(Finding(signal="cospike", kind="cospike", value=view["loss"],
                                     baseline=_exp(loss.median), z=co.magnitude,
                                     category=Category.GRAD, page=True))
        else:
            derived.update(cospike=0, cospike_count=self.cospikes.count,
                           cospike_magnitude=self.cospikes.cumulative_magnitude)
        if view["grad_norm"] is not None:
            clip = self.clip.update(view["grad_norm"] if view.get("clipped") is None
                                    else (math.inf if view["clipped"] else 0.0))
            derived.update(clip_rate=clip.rate, clipped=int(clip.clipped))
        else:
            derived.update(clip_rate=None, clipped=0)
        found += self._job(view)
        found += self._single_signals(view, sources)
        found += self._straggler(step, view)
        found += self._memory(step, view)
        found += self._experts(view, warm=not derived["warmup"])
        found += self._residual(view)
        return derived, [f for f in found if f is not None and self._gate(step, f)]

    def _job(self, view: dict[str, Any]) -> list[Finding]:
        """A missing rank pages when it is missing on two steps in a row; one step without
        it is an anomaly that does not page. A step closed early by a later step without a
        rank ("later_step") may still get its data (stored as late): measured once in
        ~2,000 healthy demo steps on Tansu. A single lost message is data loss to record,
        not a page; a dead rank misses every step and pages on the second. (Whether the
        step closed at the deadline or early is not used: it depends on which partition
        the step's key hashes to.)"""
        found = []
        missing = view["ranks_missing"]
        self.missing_run = {r: self.missing_run.get(r, 0) + 1 for r in missing}
        if missing:
            page = any(self.missing_run[r] >= 2 for r in missing)
            found.append(Finding(signal="ranks_missing", kind="threshold",
                                 value=float(len(view["ranks_missing"])), baseline=0.0, z=None,
                                 category=Category.JOB, page=page,
                                 culprit="ranks " + ",".join(map(str, view["ranks_missing"])),
                                 ranks=list(view["ranks_missing"])))
        if view.get("replay_mismatch"):
            found.append(Finding(signal="replay_mismatch", kind="threshold",
                                 value=float(view["replay_mismatch"]), baseline=0.0, z=None,
                                 category=Category.JOB, page=True,
                                 culprit="hardware: a replay did not reproduce its loss"))
        return found

    def _single_signals(self, view: dict[str, Any], sources: dict[str, float]) -> list[Finding]:
        found = []
        if view["loss"] and view["loss_worst_rank"] is not None and view["loss"] > 0:
            rank = view["loss_worst_rank_id"]
            res = self.spikes["worst_rank_ratio"].update(view["loss_worst_rank"] / view["loss"])
            found.append(_spike_finding("loss_worst_rank", res, Category.LOSS, True,
                                        f"rank {rank}", [rank]))
        for source, value in sorted(sources.items()):
            det = self.sources.setdefault(source, RobustSpikeDetector(
                window=self.config.window, threshold=self.config.signal_z))
            found.append(_spike_finding("loss_by_source", det.update(value), Category.LOSS,
                                        True, f"source {source}"))
        if view["step_time_s"] is not None:
            rank = view.get("straggler_rank")
            found.append(_spike_finding("step_time", self.spikes["step_time"].update(
                view["step_time_s"]), Category.TIME, True,
                f"rank {rank}" if rank is not None else "", [rank] if rank is not None else []))
        if view.get("output_absmax") is not None:
            found.append(_spike_finding("output_absmax", self.spikes["output_absmax"].update(
                view["output_absmax"]), Category.LAYERS, True, "output layer"))
        gamma = view.get("media_scale")
        if gamma is not None and gamma < self.config.media_scale_min:
            found.append(Finding(signal="media_scale", kind="threshold", value=gamma,
                                 baseline=self.config.media_scale_min, z=None,
                                 category=Category.LAYERS, page=True, culprit="media projector"))
        return found

    def _straggler(self, step: int, view: dict[str, Any]) -> list[Finding]:
        """`step_time` pages when the same rank's own time (step time minus its exposed
        collective wait) is ``straggler_ratio`` x the other ranks' median for
        ``straggler_steps`` consecutive steps: a ratio of the ranks to each other, so noise
        the whole host shares cancels, where the spike rule on step time drowns in it."""
        rank, score = view.get("straggler_rank"), view.get("straggler_own_ratio")
        last_rank, run, last_step = self.straggler_run
        if rank is None or score is None or not score >= self.config.straggler_ratio:
            self.straggler_run = [None, 0, step]
            return []
        run = run + 1 if (rank == last_rank and last_step is not None
                          and step == last_step + 1) else 1
        self.straggler_run = [rank, run, step]
        if run < self.config.straggler_steps:
            return []
        return [Finding(signal="step_time", kind="straggler", value=score,
                        baseline=self.config.straggler_ratio, z=None, category=Category.TIME,
                        page=True, culprit=f"rank {rank}", ranks=[rank])]

    def _memory(self, step: int, view: dict[str, Any]) -> list[Finding]:
        peak = view.get("peak_memory_bytes")
        if peak is None:
            return []
        if self.memory_baseline is None:
            self.memory_seen.append(peak)
            if len(self.memory_seen) >= self.config.window:
                ordered = sorted(self.memory_seen)
                self.memory_baseline = ordered[len(ordered) // 2]
                self.memory_seen = []
            return []
        growth = peak / self.memory_baseline - 1.0 if self.memory_baseline > 0 else 0.0
        if growth <= self.config.memory_growth:
            return []
        rank = view.get("peak_memory_rank")
        return [Finding(signal="peak_memory", kind="drift", value=peak,
                        baseline=self.memory_baseline, z=None, category=Category.MEMORY,
                        page=True, culprit=f"rank {rank}" if rank is not None else "",
                        ranks=[rank] if rank is not None else [])]

    def _experts(self, view: dict[str, Any], warm: bool) -> list[Finding]:
        """MaxVio above its threshold on ``maxvio_steps`` consecutive measured steps, after
        the detectors' warm-up: one batch's routing noise, or a router still settling
        from its initialisation, is not a collapse. The tiny demo MoE, healthy, 1,000
        steps after warm-up: MaxVio p50 0.80, p90 1.05, p99 1.29, max 1.6, and 3.0 while
        its router settles; held > 1.0 for 3 steps 11 times, > 1.5 never. A collapse onto
        2 of 8 experts (top-2) is 3.0."""
        maxvio = view.get("moe_maxvio")
        if maxvio is None:
            return []
        self.maxvio_run = self.maxvio_run + 1 if maxvio > self.config.maxvio_threshold else 0
        if self.maxvio_run < self.config.maxvio_steps or not warm:
            return []
        return [Finding(signal="moe_maxvio", kind="threshold", value=maxvio,
                        baseline=self.config.maxvio_threshold, z=None,
                        category=Category.EXPERTS, page=True,
                        culprit=view.get("moe_maxvio_layer") or "")]

    def _residual(self, view: dict[str, Any]) -> list[Finding]:
        """R_b of the weakest branch below bfloat16's relative precision: a bf16 residual
        add s + b rounds most of that branch's update away (seeds 001 §8)."""
        ratio = view.get("residual_ratio_min")
        if ratio is None or ratio >= self.config.residual_ratio_min:
            return []
        return [Finding(signal="residual_scale", kind="threshold", value=ratio,
                        baseline=self.config.residual_ratio_min, z=None,
                        category=Category.LAYERS, page=True,
                        culprit=view.get("residual_ratio_branch") or "")]

    def _gate(self, step: int, finding: Finding) -> bool:
        """Pages once per episode of a signal; anomalies that don't page always pass."""
        if not finding.page:
            return True
        # one episode per signal; per-source losses are separate signals, one per source
        key = finding.signal + (f":{finding.culprit}" if finding.signal == "loss_by_source"
                                else "")
        last = self.last_page.get(key)
        self.last_page[key] = step
        return last is None or step - last > self.config.rearm_steps

    # -- persistence ------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {"spikes": {k: d.to_state() for k, d in self.spikes.items()},
                "sources": {k: d.to_state() for k, d in self.sources.items()},
                "cospikes": self.cospikes.to_state(), "clip": self.clip.to_state(),
                "memory_baseline": self.memory_baseline, "memory_seen": self.memory_seen,
                "maxvio_run": self.maxvio_run,
                "missing_run": {str(r): n for r, n in self.missing_run.items()},
                "last_page": self.last_page,
                "straggler_run": list(self.straggler_run)}

    @classmethod
    def from_state(cls, config: DetectorConfig, state: dict[str, Any]) -> "SignalDetectors":
        det = cls(config)
        det.spikes = {k: RobustSpikeDetector.from_state(v) for k, v in state["spikes"].items()}
        det.sources = {k: RobustSpikeDetector.from_state(v) for k, v in state["sources"].items()}
        det.cospikes = CoSpikeTracker.from_state(state["cospikes"])
        det.clip = ClipRateWindow.from_state(state["clip"])
        det.memory_baseline = state["memory_baseline"]
        det.memory_seen = list(state["memory_seen"])
        det.maxvio_run = int(state.get("maxvio_run", 0))  # absent in states saved before it
        det.missing_run = {int(r): int(n) for r, n in state.get("missing_run", {}).items()}
        det.last_page = dict(state["last_page"])
        det.straggler_run = list(state.get("straggler_run", [None, 0, None]))  # older states
        return det


def _exp(u: float | None) -> float | None:
    return None if u is None else math.exp(u)
