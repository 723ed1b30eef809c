"""The P0 rules that watch one direction of a signal against its own history or a bound
(issue 38): each names what moved, its baseline and its culprit.

* ``loss_rank_shift`` (up): one rank's own loss over the other ranks' median, a CUSUM per
  rank (``shifts.PeerShift``): a persistent shift, not a spike;
* ``grad_norm_audit`` (either way): the loop's own clipping norm against G2;
* ``clip_rate`` (up): the clip rate over a full window above its own baseline by
  ``clip_rate_rise`` (a sustained clip rate is an unplanned learning-rate schedule);
* ``compute_rate`` (down): Phi below its history (robust z) on ``straggler_steps`` steps;
* ``moe_shard_imbalance`` (up): the busiest expert-parallel shard above
  ``shard_imbalance_max`` x the mean on ``maxvio_steps`` measured steps after warm-up;
* ``moe_h_norm`` (down): the router's normalized entropy ``h_norm_drop`` below its own
  baseline on ``maxvio_steps`` measured steps after warm-up (a collapse, before MaxVio);
* ``modality_token_share`` (either way): a modality's token share pi ``pi_shift`` away from
  its own baseline on ``maxvio_steps`` measured steps (a data-mix or packing change);
* ``media_scale`` (up; ``signals`` has the small side): gamma above ``media_scale_max``
  (media tokens swamp the backbone's first layers);
* ``residual_scale`` (up; ``signals`` has the small side): the largest branch's R_b above
  ``residual_ratio_max`` (a branch that overwrites the residual stream), naming the branch;
* ``vanishing_gradients`` (down): G2, or one gradient parameter group's G_max (named), below
  ``vanish_ratio`` x its own baseline on ``straggler_steps`` measured steps;
* ``memory_headroom`` (down): 1 - peak / capacity of the worst rank below
  ``headroom_min``.

A baseline is the median of the signal's own measured history (its last ``window`` values
before the step). Pure and serialisable, like ``detect``.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Mapping
from typing import Any

from .derive import own_time_ratios
from .detect import RobustSpikeDetector
from .findings import Category, DetectorConfig, Finding, RankSeries
from .rolling import sorted_median
from .series import StepMetrics as SM
from .shifts import PeerShift

__all__ = ["DirectionalRules", "History", "norm_mismatch"]


def norm_mismatch(reported: float | None, measured: float | None) -> float | None:
    """|reported - measured| / measured (0 when both are 0); None when either is missing
    or not finite (a non-finite G2 pages on its own)."""
    if reported is None or measured is None:
        return None
    if not (math.isfinite(reported) and math.isfinite(measured)):
        return None
    if measured == 0.0:
        return 0.0 if reported == 0.0 else math.inf
    return abs(reported - measured) / abs(measured)


_SINCE_NONFINITE = "since_nonfinite_g2"  # a ``runs`` counter: steps since G2 was non-finite


class History:
    """The last ``window`` finite values of one signal, in arrival order and ascending: the
    median of what came before a step is its baseline (``np.median``, bit for bit)."""

    def __init__(self, window: int, values: list[float] | None = None) -> None:
        self.window = window
        self.values: deque[float] = deque(maxlen=window)
        self.ordered: list[float] = []
        for v in values or ():
            self.add(v)

    def baseline(self, min_history: int) -> float | None:
        return sorted_median(self.ordered) if len(self.ordered) >= min_history else None

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        if len(self.values) == self.window:
            del self.ordered[bisect_left(self.ordered, self.values[0])]
        self.values.append(value)
        insort(self.ordered, value)


def _finding(signal: str, kind: str, value: float, baseline: float | None, **kw: Any) -> Finding:
    return Finding(
        signal=signal,
        kind=kind,
        value=value,
        baseline=baseline,
        z=kw.pop("z", None),
        page=True,
        **kw,
    )


class DirectionalRules:
    """The state of the rules above for one run."""

    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        cfg = config
        self.loss_shift = PeerShift(
            window=cfg.window,
            min_history=min(cfg.shift_history, cfg.window),
            k=cfg.loss_shift_k,
            cap=cfg.loss_shift_cap,
            h=cfg.loss_shift_h,
            min_scale=cfg.loss_shift_scale,
            delay=cfg.loss_shift_delay,
        )
        self.history: dict[str, History] = {}
        self.phi = RobustSpikeDetector(
            window=cfg.window, threshold=cfg.signal_z, min_spread=cfg.min_spread
        )
        self.runs: dict[str, int] = {}  # rule -> consecutive steps its condition held

    def _held(self, rule: str, condition: bool) -> int:
        self.runs[rule] = self.runs.get(rule, 0) + 1 if condition else 0
        return self.runs[rule]

    def _base(self, key: str, value: float | None) -> float | None:
        """The key's baseline before ``value``, then ``value`` into its history."""
        history = self.history.setdefault(key, History(self.config.window))
        base = history.baseline(min(self.config.shift_history, self.config.window))
        if value is not None:
            history.add(value)
        return base

    def observe(
        self,
        view: Mapping[str, Any],
        derived: Mapping[str, Any],
        ranks: RankSeries,
        warm: bool,
    ) -> list[Finding]:
        g2 = view[SM.grad_norm]
        finite = g2 is None or math.isfinite(g2)  # since a non-finite G2 (capped):
        since = self.runs.get(_SINCE_NONFINITE, self.config.straggler_steps)
        self.runs[_SINCE_NONFINITE] = min(since + 1, self.config.straggler_steps) if finite else 0
        found = self._rank_shift(ranks.loss)
        found += self._audit(view)
        found += self._clip_rate(derived, view[SM.grad_norm])
        found += self._compute_rate(view)
        found += self._experts(view, warm)
        found += self._token_share(view)
        found += self._bounds(view)
        found += self._parts(ranks)
        return found

    def _rank_shift(self, losses: Mapping[int, float]) -> list[Finding]:
        """A persistent shift of one rank's own loss: L_r over the other ranks' median (the
        trend and a batch every rank sees cancel) against that ratio's own history; the
        page carries the rank's loss and the loss its usual ratio to the others puts it at."""
        valid = {r: v for r, v in losses.items() if math.isfinite(v) and v > 0}
        return [
            _finding(
                "loss_rank_shift",
                "shift",
                valid[res.key],
                valid[res.key] / res.ratio * res.baseline,
                z=math.log(res.ratio / res.baseline) / res.scale,
                category=Category.LOSS,
                culprit=f"rank {res.key}",
                ranks=[res.key],
            )
            for res in self.loss_shift.update(own_time_ratios(valid))
            if res.shift
        ]

    def _audit(self, view: Mapping[str, Any]) -> list[Finding]:
        """The norm the loop clipped with (its own computation, when it reports one) against
        G2 from the owners' squared sums, every step: a mismatch above
        ``grad_audit_tolerance`` (1%: bf16 per-tensor norms round by ~0.4%) is a wrong norm
        (a loop that norms only its local shard reports about G2 / sqrt(shards)), and its
        clipping is wrong with it."""
        reported, g2 = view.get(SM.grad_clip_norm), view[SM.grad_norm]
        mismatch = norm_mismatch(reported, g2)
        if reported is None or mismatch is None or mismatch <= self.config.grad_audit_tolerance:
            return []
        return [
            _finding(
                "grad_norm_audit",
                "mismatch",
                float(reported),
                g2,
                category=Category.GRAD,
                culprit="the loop's gradient norm",
            )
        ]

    def _clip_rate(self, derived: Mapping[str, Any], g2: float | None) -> list[Finding]:
        """Once the clip window is full (a rate over fewer steps jumps by 1/n a step); not
        while G2 is non-finite (a NaN norm counts as clipped, and pages on its own)."""
        rate = derived.get(SM.clip_rate)
        if rate is None:
            return []
        seen = self.runs["clip_steps"] = self.runs.get("clip_steps", 0) + 1
        if seen < self.config.clip_window or g2 is None or not math.isfinite(g2):
            return []
        base = self._base(SM.clip_rate, rate)
        if base is None or rate - base < self.config.clip_rate_rise:
            return []
        return [_finding(SM.clip_rate, "drift", rate, base, category=Category.GRAD)]

    def _compute_rate(self, view: Mapping[str, Any]) -> list[Finding]:
        phi = view.get(SM.compute_rate)
        if phi is None:
            return []
        res = self.phi.update(phi)
        down = res.z is not None and res.direction < 0 and res.z > self.phi.threshold
        if self._held("phi", down) < self.config.straggler_steps or res.median is None:
            return []
        return [
            _finding(
                SM.compute_rate, "drop", phi, math.exp(res.median), z=res.z, category=Category.TIME
            )
        ]

    def _experts(self, view: Mapping[str, Any], warm: bool) -> list[Finding]:
        cfg, found = self.config, []
        shard = view.get(SM.moe_shard_imbalance)
        if shard is not None:
            held = self._held("shard", shard > cfg.shard_imbalance_max)
            if warm and held >= cfg.maxvio_steps:
                found.append(
                    _finding(
                        SM.moe_shard_imbalance,
                        "threshold",
                        shard,
                        cfg.shard_imbalance_max,
                        category=Category.EXPERTS,
                    )
                )
        h = view.get(SM.moe_h_norm)
        if h is not None:
            base = self._base(SM.moe_h_norm, h)
            drop = base is not None and base - h >= cfg.h_norm_drop
            if warm and self._held("h_norm", drop) >= cfg.maxvio_steps:
                found.append(_finding(SM.moe_h_norm, "drop", h, base, category=Category.EXPERTS))
        return found

    def _token_share(self, view: Mapping[str, Any]) -> list[Finding]:
        found = []
        for modality, share in sorted((view.get(SM.modality_token_share) or {}).items()):
            base = self._base(f"pi:{modality}", share)
            moved = base is not None and abs(share - base) >= self.config.pi_shift
            if self._held(f"pi:{modality}", moved) >= self.config.maxvio_steps:
                found.append(
                    _finding(
                        SM.modality_token_share,
                        "shift",
                        share,
                        base,
                        category=Category.LAYERS,
                        culprit=f"modality {modality}",
                    )
                )
        return found

    def observe_scan(self, view: Mapping[str, Any], ranks: RankSeries) -> list[Finding]:
        """The rules on scan-tier values alone (a scan step joined after its step was
        scored, ``scanjoin``): the media scale's upper bound and the residual branches."""
        return self._media_scale(view) + self._parts(ranks)

    def _media_scale(self, view: Mapping[str, Any]) -> list[Finding]:
        gamma = view.get(SM.media_scale)
        if gamma is None or gamma <= self.config.media_scale_max:
            return []
        return [
            _finding(
                SM.media_scale,
                "threshold",
                gamma,
                self.config.media_scale_max,
                category=Category.LAYERS,
                culprit="media projector",
            )
        ]

    def _bounds(self, view: Mapping[str, Any]) -> list[Finding]:
        cfg, found = self.config, self._media_scale(view)
        found += self._vanishing(SM.grad_norm, "vanish", view[SM.grad_norm], "")
        headroom = view.get(SM.memory_headroom)
        if headroom is not None and headroom < cfg.headroom_min:
            rank = view.get(SM.peak_memory_rank)
            found.append(
                _finding(
                    SM.memory_headroom,
                    "threshold",
                    headroom,
                    cfg.headroom_min,
                    category=Category.MEMORY,
                    culprit="" if rank is None else f"rank {rank}",
                    ranks=[] if rank is None else [int(rank)],
                )
            )
        return found

    def _vanishing(self, key: str, run: str, value: float | None, culprit: str) -> list[Finding]:
        """``value`` below ``vanish_ratio`` x its baseline on ``straggler_steps`` measured
        steps in a row (a step that does not measure it neither counts nor resets); not
        within ``straggler_steps`` steps of a non-finite G2 (which pages on its own)."""
        if value is None:
            return []
        if (
            self.runs.get(_SINCE_NONFINITE, self.config.straggler_steps)
            < self.config.straggler_steps
        ):
            self._held(run, False)  # gradients that just went non-finite (zeroed or skipped
            return []  # steps after it) are that page's, not a collapse: not counted
        base = self._base(key, value)
        small = base is not None and value < self.config.vanish_ratio * base
        if self._held(run, small) < self.config.straggler_steps:
            return []
        return [
            _finding(
                "vanishing_gradients", "drop", value, base, category=Category.GRAD, culprit=culprit
            )
        ]

    def _parts(self, ranks: RankSeries) -> list[Finding]:
        """The largest branch's R_b above its bound; each gradient group's G_max collapsing."""
        found = []
        if ranks.branch_ratio:
            branch = max(sorted(ranks.branch_ratio), key=ranks.branch_ratio.__getitem__)
            ratio = ranks.branch_ratio[branch]
            if ratio > self.config.residual_ratio_max:
                found.append(
                    _finding(
                        "residual_scale",
                        "threshold",
                        ratio,
                        self.config.residual_ratio_max,
                        category=Category.LAYERS,
                        culprit=branch,
                    )
                )
        for group, gmax in sorted(ranks.group_grad_max.items()):
            found += self._vanishing(f"gmax:{group}", f"vanish:{group}", gmax, f"group {group}")
        return found

    def to_state(self) -> dict[str, Any]:
        return {
            "loss_shift": self.loss_shift.to_state(),
            "history": {k: list(h.values) for k, h in self.history.items()},
            "phi": self.phi.to_state(),
            "runs": dict(self.runs),
        }

    @classmethod
    def from_state(
        cls, config: DetectorConfig, state: Mapping[str, Any] | None
    ) -> DirectionalRules:
        rules = cls(config)
        if state:
            rules.loss_shift = PeerShift.from_state(state["loss_shift"])
            rules.history = {k: History(config.window, v) for k, v in state["history"].items()}
            rules.phi = RobustSpikeDetector.from_state(state["phi"])
            rules.runs = {k: int(v) for k, v in state["runs"].items()}
        return rules
