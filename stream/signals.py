"""P0 signals: which per-step values page, how each is detected, what to open next.

Every rule reads the step's P0 view and runs one detector on it: a robust spike detector
on log(x + ε) (seeds 001 §4, its spread floored relative to the level), a threshold, or a
drift test against the run's own post-warm-up baseline. A rule that names a culprit pages
on the culprit's own move: the worst rank's own loss L_r against that rank's history, a
source's own loss against its history (each together with the gap to the whole, L_max / L
or L_source / L, so a move every rank or source shares is the co-spike's, not theirs), and
the straggler's own-time ratio against its own history (``stragglers``). The held-out
BPB the evaluator sends beside the steps has its own rule (``heldout``). Findings carry
their escalation category (job state → loss → gradient norm and spikes → step time →
memory → expert balance, then layer views; seeds 001 §1), so an alert says what to open
next.

Every finding is returned, and stage 2 records every one (anomaly row, retention halo);
``pages.PageGate`` only deduplicates pages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .detect import (
    ClipRateWindow,
    CoSpikeTracker,
    RobustSpikeDetector,
    SpikeResult,
    pack_detectors,
    unpack_detectors,
)
from .directions import DirectionalRules
from .findings import Category, DetectorConfig, Finding, RankSeries, next_steps
from .heldout import HeldoutRise
from .pages import PageGate
from .series import StepMetrics as SM
from .stragglers import StragglerRules

__all__ = [
    "Category",
    "DetectorConfig",
    "Finding",
    "RankSeries",
    "SignalDetectors",
    "next_steps",
]


def _spike_finding(
    signal: str,
    res: SpikeResult,
    category: Category,
    page: bool,
    culprit: str = "",
    ranks: list[int] | None = None,
) -> Finding | None:
    if not res.spike or (res.direction is not None and res.direction < 0 and not res.nonfinite):
        return None
    baseline = None if res.median is None else math.exp(res.median)
    return Finding(
        signal=signal,
        kind="nonfinite" if res.nonfinite else "spike",
        value=res.x,
        baseline=baseline,
        z=res.z,
        category=category,
        page=page,
        culprit=culprit,
        ranks=ranks or [],
    )


class SignalDetectors:
    """All per-run detector state; serialisable with ``to_state``/``from_state``."""

    _SPIKE_SIGNALS = (SM.loss, SM.grad_norm, "worst_rank_ratio", "step_time", SM.output_absmax)

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.spikes = {
            SM.loss: self._detector(config.loss_z, early=True),
            SM.grad_norm: self._detector(config.grad_z, early=True),
            "worst_rank_ratio": self._detector(config.signal_z, early=True),
            **{name: self._detector(config.signal_z) for name in self._SPIKE_SIGNALS[3:]},
        }
        self.sources: dict[str, RobustSpikeDetector] = {}  # L_source / L, per source
        self.source_loss: dict[str, RobustSpikeDetector] = {}  # L_source, per source
        self.rank_loss: dict[int, RobustSpikeDetector] = {}  # L_r, per rank
        self.stragglers = StragglerRules(config)
        self.heldout = HeldoutRise(config)
        self.directions = DirectionalRules(config)
        self.cospikes = CoSpikeTracker()
        self.clip = ClipRateWindow(window=config.clip_window, threshold_c=config.clip_threshold)
        self.memory_baseline: float | None = None
        self.memory_seen: list[float] = []
        self.maxvio_run = 0  # consecutive measured steps with MaxVio above its threshold
        self.step_time_run = 0  # consecutive steps with a step-time spike
        self.missing_run: dict[int, int] = {}  # rank -> consecutive steps it was missing
        self.pages = PageGate(config.rearm_steps)

    def _detector(self, threshold: float, early: bool = False) -> RobustSpikeDetector:
        """A robust spike detector on the run's window; ``early``: scored from
        ``early_history`` values on, at ``early_z_factor`` x ``threshold`` until the window
        is full (a spike in a run's first steps pages)."""
        cfg = self.config
        early_history = min(cfg.early_history, cfg.window) if early else None
        return RobustSpikeDetector(
            window=cfg.window,
            threshold=threshold,
            min_spread=cfg.min_spread,
            early_history=early_history,
            early_threshold=threshold * cfg.early_z_factor if early else None,
        )

    # -- one step ---------------------------------------------------------------------------
    def observe(
        self,
        step: int,
        view: dict[str, Any],
        sources: Mapping[str, float],
        ranks: RankSeries | None = None,
    ) -> tuple[dict[str, Any], list[Finding]]:
        """Update every detector with one step's P0 view; return derived fields and every
        finding (paging or not: the page gate is ``pages``, applied by stage 2).

        ``sources`` maps each data source to its valid-token mean loss L_source; ``ranks``
        holds each rank's local mean loss and own-time ratio."""
        ranks = ranks or RankSeries()
        derived: dict[str, Any] = {}
        found: list[Finding | None] = [*self._spikes(view, derived)]
        found += self._job(view)
        worst = self._worst_rank(view, ranks.loss)
        found += worst
        found += self._sources(
            view,
            sources,
            ranks.source_loss_without_worst
            if any(f is not None and f.page for f in worst)
            else None,
        )
        found += self.stragglers.observe(step, ranks.own_ratio, self._step_time_ratio(view))
        found += self._single_signals(view)
        found += self._memory(step, view)
        found += self._experts(view, warm=not derived[SM.warmup])
        found += self._residual(view)
        found += self.directions.observe(view, derived, ranks, warm=not derived[SM.warmup])
        return derived, [f for f in found if f is not None]

    def observe_scan(self, view: dict[str, Any], ranks: RankSeries) -> list[Finding]:
        """The rules on a step's scan-tier columns when its scan-tier detail joined the
        step's row after the step was scored (``scanjoin``): ``view`` holds only the columns
        the detail filled (the rest None) and ``ranks`` its residual branches; the same
        rules ``observe`` runs on those columns, and no other detector moves."""
        found = self._single_signals(view)  # no step time: the output |x|max and gamma
        found += self._residual(view)
        found += self.directions.observe_scan(view, ranks)
        return found

    def _spikes(self, view: dict[str, Any], derived: dict[str, Any]) -> list[Finding | None]:
        """L and G2 against their histories, their co-spikes and the clip window; fills the
        step's detector columns into ``derived``."""
        found: list[Finding | None] = []
        loss = self.spikes[SM.loss].update(view[SM.loss]) if view[SM.loss] is not None else None
        grad = (
            self.spikes[SM.grad_norm].update(view[SM.grad_norm])
            if view[SM.grad_norm] is not None
            else None
        )
        derived[SM.loss_z] = None if loss is None else loss.z
        derived[SM.grad_z] = None if grad is None else grad.z
        derived[SM.loss_spike] = int(bool(loss and loss.spike))
        derived[SM.grad_spike] = int(bool(grad and grad.spike))
        derived[SM.warmup] = int(bool(loss is None or loss.warmup))
        for res, name in ((loss, SM.loss), (grad, SM.grad_norm)):
            if res is not None and res.nonfinite:
                found.append(
                    Finding(
                        signal=name,
                        kind="nonfinite",
                        value=res.x,
                        baseline=None,
                        z=None,
                        category=Category.LOSS if name == SM.loss else Category.GRAD,
                        page=True,
                    )
                )
            elif res is not None and res.spike:
                found.append(_spike_finding(name, res, Category.GRAD, page=False))
        if loss is not None and grad is not None:
            co = self.cospikes.update(loss, grad)
            derived.update(
                {
                    SM.cospike: int(co.co_spike),
                    SM.cospike_count: co.count,
                    SM.cospike_magnitude: co.cumulative_magnitude,
                }
            )
            if co.co_spike and not co.nonfinite:
                found.append(
                    Finding(
                        signal=SM.cospike,
                        kind="cospike",
                        value=view[SM.loss],
                        baseline=_exp(loss.median),
                        z=co.magnitude,
                        category=Category.GRAD,
                        page=True,
                    )
                )
        else:
            derived.update(
                {
                    SM.cospike: 0,
                    SM.cospike_count: self.cospikes.count,
                    SM.cospike_magnitude: self.cospikes.cumulative_magnitude,
                }
            )
        if view[SM.grad_norm] is not None:
            clip = self.clip.update(
                view[SM.grad_norm]
                if view.get(SM.clipped) is None
                else (math.inf if view[SM.clipped] else 0.0)
            )
            derived.update({SM.clip_rate: clip.rate, SM.clipped: int(clip.clipped)})
        else:
            derived.update({SM.clip_rate: None, SM.clipped: 0})
        return found

    def _job(self, view: dict[str, Any]) -> list[Finding]:
        """A missing rank pages when it is missing on two steps in a row; one step without
        it is an anomaly that does not page. A step closed early by a later step without a
        rank ("later_step") may still get its data (stored as late): measured once in
        ~2,000 healthy demo steps on Tansu. A single lost message is data loss to record,
        not a page; a dead rank misses every step and pages on the second. (Whether the
        step closed at the deadline or early is not used: it depends on which partition
        the step's key hashes to.)"""
        found = []
        missing = view[SM.ranks_missing]
        self.missing_run = {r: self.missing_run.get(r, 0) + 1 for r in missing}
        if missing:
            page = any(self.missing_run[r] >= 2 for r in missing)
            found.append(
                Finding(
                    signal=SM.ranks_missing,
                    kind="threshold",
                    value=float(len(view[SM.ranks_missing])),
                    baseline=0.0,
                    z=None,
                    category=Category.JOB,
                    page=page,
                    culprit="ranks " + ",".join(map(str, view[SM.ranks_missing])),
                    ranks=list(view[SM.ranks_missing]),
                )
            )
        if view.get(SM.replay_mismatch_step):
            found.append(
                Finding(
                    signal=SM.replay_mismatch,
                    kind="threshold",
                    value=float(view[SM.replay_mismatch_step]),
                    baseline=0.0,
                    z=None,
                    category=Category.JOB,
                    page=True,
                    culprit="hardware: a replay did not reproduce its loss",
                )
            )
        return found

    def _culprit_move(
        self,
        signal: str,
        culprit: str,
        ranks: list[int],
        value: float,
        gap: SpikeResult,
        own: SpikeResult | None,
    ) -> Finding | None:
        """The worst-rank and per-source rule: a page when the gap to the whole (L_max / L,
        L_source / L) and the culprit's own loss against its own history both rose; the gap
        alone (the rest fell: an easy batch elsewhere) is an anomaly that does not page."""
        if gap.nonfinite:
            return Finding(
                signal=signal,
                kind="nonfinite",
                value=value,
                baseline=None,
                z=None,
                category=Category.LOSS,
                page=True,
                culprit=culprit,
                ranks=ranks,
            )
        if not (gap.spike and gap.direction > 0):
            return None
        if own is not None and own.spike and own.direction > 0 and not own.nonfinite:
            return Finding(
                signal=signal,
                kind="spike",
                value=value,
                baseline=_exp(own.median),
                z=own.z,
                category=Category.LOSS,
                page=True,
                culprit=culprit,
                ranks=ranks,
            )
        return Finding(
            signal=signal,
            kind="gap",
            value=gap.x,
            baseline=_exp(gap.median),
            z=gap.z,
            category=Category.LOSS,
            page=False,
            culprit=culprit,
            ranks=ranks,
        )

    def _worst_rank(
        self, view: dict[str, Any], losses: Mapping[int, float]
    ) -> list[Finding | None]:
        """L_max / L against its history, and the worst rank's own L_r against that rank's
        history (every rank's L_r enters its own window every step)."""
        rank = view.get(SM.loss_worst_rank_id)
        own = None
        for r, value in sorted(losses.items()):
            det = self.rank_loss.get(r)
            if det is None:
                det = self.rank_loss[r] = self._detector(self.config.signal_z)
            if r == rank:
                own = det.update(value)
            else:
                det.push(value)
        found: list[Finding | None] = []
        if not (view[SM.loss] and view[SM.loss_worst_rank] is not None and view[SM.loss] > 0):
            return found
        gap = self.spikes["worst_rank_ratio"].update(view[SM.loss_worst_rank] / view[SM.loss])
        return found + [
            self._culprit_move(
                SM.loss_worst_rank,
                f"rank {rank}",
                [] if rank is None else [int(rank)],
                view[SM.loss_worst_rank],
                gap,
                own,
            )
        ]

    def _sources(
        self,
        view: dict[str, Any],
        sources: Mapping[str, float],
        without_worst: Mapping[str, float] | None = None,
    ) -> list[Finding | None]:
        """Each source's L_source / L and its own L_source, both against their histories
        (seeds 001 §3: compare each group against its own history). When the worst rank's
        own loss paged at this step (``without_worst``: each source's loss over the other
        ranks), a source pages only if it moved without that rank too: a bad rank raises
        every source it holds, most those whose loss is usually lowest, and it is the
        culprit; a move that stays is the source's own (recorded as ``via_rank`` if not)."""
        found = []
        for source, value in sorted(sources.items()):
            own = self.source_loss.get(source)
            if own is None:
                own = self.source_loss[source] = self._detector(self.config.signal_z)
                self.sources[source] = self._detector(self.config.signal_z)
            rest = (
                None
                if without_worst is None or source not in without_worst
                else own.peek(without_worst[source])
            )
            own_res = own.update(value)
            if not (view[SM.loss] and math.isfinite(view[SM.loss])):
                continue
            gap = self.sources[source].update(value / view[SM.loss])
            finding = self._culprit_move(
                "loss_by_source", f"source {source}", [], value, gap, own_res
            )
            if (
                finding is not None
                and without_worst is not None
                and finding.kind == "spike"
                and not (rest is not None and rest.spike and rest.direction > 0)
            ):
                finding.kind, finding.page = "via_rank", False
            found.append(finding)
        return found

    def _step_time_ratio(self, view: dict[str, Any]) -> float | None:
        """The step time over its baseline, exp(u_t - q_t) of the step-time spike detector
        (q_t: the median of the window the step is about to be scored against); None while
        that window fills or without a finite, positive step time."""
        x = view.get(SM.step_time_s)
        detector = self.spikes["step_time"]
        q = detector.median()
        if x is None or q is None or not (math.isfinite(x) and x > 0.0):
            return None
        return math.exp(math.log(x + detector.eps) - q)

    def _single_signals(self, view: dict[str, Any]) -> list[Finding]:
        """Step time against its own history: a spike is an anomaly, and pages when it holds
        for ``straggler_steps`` consecutive steps (a stall of the whole job; one slow step
        on a busy host is not a page). Output |x|max spikes; the media scale γ."""
        found: list[Finding | None] = []
        if view[SM.step_time_s] is not None:
            res = self.spikes["step_time"].update(view[SM.step_time_s])
            up = res.spike and (res.direction > 0 or res.nonfinite)
            self.step_time_run = self.step_time_run + 1 if up else 0
            rank = self.stragglers.pace_setter()
            found.append(
                _spike_finding(
                    "step_time",
                    res,
                    Category.TIME,
                    self.step_time_run >= self.config.straggler_steps,
                    "" if rank is None else f"rank {rank}",
                    None if rank is None else [rank],
                )
            )
        if view.get(SM.output_absmax) is not None:
            found.append(
                _spike_finding(
                    SM.output_absmax,
                    self.spikes[SM.output_absmax].update(view[SM.output_absmax]),
                    Category.LAYERS,
                    True,
                    "output layer",
                )
            )
        gamma = view.get(SM.media_scale)
        if gamma is not None and gamma < self.config.media_scale_min:
            found.append(
                Finding(
                    signal=SM.media_scale,
                    kind="threshold",
                    value=gamma,
                    baseline=self.config.media_scale_min,
                    z=None,
                    category=Category.LAYERS,
                    page=True,
                    culprit="media projector",
                )
            )
        return [f for f in found if f is not None]

    def _memory(self, step: int, view: dict[str, Any]) -> list[Finding]:
        peak = view.get(SM.peak_memory_bytes)
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
        rank = view.get(SM.peak_memory_rank)
        return [
            Finding(
                signal="peak_memory",
                kind="drift",
                value=peak,
                baseline=self.memory_baseline,
                z=None,
                category=Category.MEMORY,
                page=True,
                culprit=f"rank {rank}" if rank is not None else "",
                ranks=[rank] if rank is not None else [],
            )
        ]

    def _experts(self, view: dict[str, Any], warm: bool) -> list[Finding]:
        """MaxVio above its threshold on ``maxvio_steps`` consecutive measured steps, after
        the detectors' warm-up: one batch's routing noise, or a router still settling
        from its initialisation, is not a collapse. The tiny demo MoE, healthy, 1,000
        steps after warm-up: MaxVio p50 0.80, p90 1.05, p99 1.29, max 1.6, and 3.0 while
        its router settles; held > 1.0 for 3 steps 11 times, > 1.5 never. A collapse onto
        2 of 8 experts (top-2) is 3.0."""
        maxvio = view.get(SM.moe_maxvio)
        if maxvio is None:
            return []
        self.maxvio_run = self.maxvio_run + 1 if maxvio > self.config.maxvio_threshold else 0
        if self.maxvio_run < self.config.maxvio_steps or not warm:
            return []
        return [
            Finding(
                signal=SM.moe_maxvio,
                kind="threshold",
                value=maxvio,
                baseline=self.config.maxvio_threshold,
                z=None,
                category=Category.EXPERTS,
                page=True,
                culprit=view.get("moe_maxvio_layer") or "",
            )
        ]

    def _residual(self, view: dict[str, Any]) -> list[Finding]:
        """R_b of the weakest branch below bfloat16's relative precision: a bf16 residual
        add s + b rounds most of that branch's update away (seeds 001 §8)."""
        ratio = view.get(SM.residual_ratio_min)
        if ratio is None or ratio >= self.config.residual_ratio_min:
            return []
        return [
            Finding(
                signal="residual_scale",
                kind="threshold",
                value=ratio,
                baseline=self.config.residual_ratio_min,
                z=None,
                category=Category.LAYERS,
                page=True,
                culprit=view.get(SM.residual_ratio_branch) or "",
            )
        ]

    # -- persistence ------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {
            "spikes": {k: d.to_state() for k, d in self.spikes.items()},
            "sources": {k: d.to_state() for k, d in self.sources.items()},
            "source_loss": {k: d.to_state() for k, d in self.source_loss.items()},
            "rank_loss": pack_detectors(self.rank_loss),
            **self.stragglers.to_state(),
            "heldout": self.heldout.to_state(),
            "directions": self.directions.to_state(),
            "cospikes": self.cospikes.to_state(),
            "clip": self.clip.to_state(),
            "memory_baseline": self.memory_baseline,
            "memory_seen": self.memory_seen,
            "maxvio_run": self.maxvio_run,
            "step_time_run": self.step_time_run,
            "missing_run": {str(r): n for r, n in self.missing_run.items()},
            "pages": self.pages.to_state(),
        }

    @classmethod
    def from_state(cls, config: DetectorConfig, state: dict[str, Any]) -> SignalDetectors:
        """Rebuild from ``to_state``; keys a state saved by an older version lacks start
        fresh (a rank's or source's own-loss window, the straggler levels)."""
        det = cls(config)
        det.spikes = {k: RobustSpikeDetector.from_state(v) for k, v in state["spikes"].items()}
        det.sources = {k: RobustSpikeDetector.from_state(v) for k, v in state["sources"].items()}
        det.source_loss = {
            k: RobustSpikeDetector.from_state(v) for k, v in state.get("source_loss", {}).items()
        }
        for source in det.sources.keys() - det.source_loss.keys():
            det.source_loss[source] = det._detector(config.signal_z)
        det.rank_loss = unpack_detectors(state.get("rank_loss", {}))
        det.stragglers = StragglerRules(config, state)
        det.heldout = HeldoutRise(config, state.get("heldout"))  # absent: saved before it
        det.directions = DirectionalRules.from_state(config, state.get("directions"))
        det.cospikes = CoSpikeTracker.from_state(state["cospikes"])
        det.clip = ClipRateWindow.from_state(state["clip"])
        det.memory_baseline = state["memory_baseline"]
        det.memory_seen = list(state["memory_seen"])
        det.maxvio_run = int(state.get("maxvio_run", 0))  # absent in states saved before it
        det.step_time_run = int(state.get("step_time_run", 0))
        det.missing_run = {int(r): int(n) for r, n in state.get("missing_run", {}).items()}
        det.pages = PageGate.from_state(
            config.rearm_steps, state.get("pages", state.get("last_page", {}))
        )
        return det


def _exp(u: float | None) -> float | None:
    return None if u is None else math.exp(u)
