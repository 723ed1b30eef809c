"""The walk of ``probewire explain`` over loaded data: each signal scored against its own
history, in the escalation order, and the pages at the step matched to their findings.

The walk follows seeds 001 §1: job state → loss → gradient norm and spikes → step time →
memory → expert balance, then the layer views (backward |g|max from the output inward,
seeds 001 §6 "Reading an explosion"). Each signal is scored against its own history:

* the scanned stretch is the last ``lookback`` steps up to the explained one; the history
  is the ``window`` steps before it;
* baseline of a scale-like signal (L, G2, step time, memory, |x|max), in log space: the
  Theil–Sen line (median pairwise slope, median intercept) of its last ``trend_window``
  history points, carried to the scanned step, so a loss that is still falling is not
  read as flat; baseline of a ratio (below) or a fraction (clip rate, MaxVio): the plain
  median of its history;
* z = ``detect.robust_z`` of the value's deviation from that baseline against the MAD of
  the history's residuals, with the stream detectors' spread floor (relative to the
  level: a constant history does not turn a 5% move into z ~ 1e6);
* moved: z ≥ ``z_threshold`` and the value differs from the baseline by at least
  ``min_change`` (relative), upward (every signal here is worse when it rises);
* onset: the first step of the episode the reported step belongs to (the run of
  consecutive moved scanned steps that ends there).

Loss by source is the ratio L_source / L against that ratio's own history (absolute
levels differ between sources, and the ratio removes the trend all sources share); the
worst rank is the gap L_max / L. Findings are ranked in the escalation order and, within
a stage, by the size of the move at the explained step (``Explanation.ranked``); what
paged at the step comes first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from probewire.stream.derive import own_time_ratios, own_times
from probewire.stream.detect import median_mad, robust_z, spread_floor
from probewire.stream.localize import layer_of_tensor
from probewire.stream.records import CompleteReason
from probewire.stream.series import StepMetrics as SM

from .load import Loaded
from .model import STAGES, Explanation, Finding, Page

__all__ = ["PAGE_FINDINGS", "score"]

_EPS = 1e-8

# alert signal -> (stage: the category the stream gave it, the explain finding that shows it;
# {source} filled from the culprit)
PAGE_FINDINGS = {
    SM.ranks_missing: ("job state", SM.ranks_missing),
    SM.replay_mismatch: ("job state", SM.replay_mismatch),
    SM.loss: ("loss", SM.loss),
    SM.loss_worst_rank: ("loss", SM.loss_worst_rank),
    "loss_rank_shift": ("loss", SM.loss_worst_rank),
    "loss_by_source": ("loss", "source:{source}"),
    "heldout_bpb": ("loss", "heldout_bpb"),
    SM.grad_norm: ("gradient", SM.grad_norm),
    SM.cospike: ("gradient", SM.cospike_count),
    "grad_norm_audit": ("gradient", SM.grad_norm),
    SM.output_absmax: ("layers", SM.output_absmax),
    "step_time": ("step time", SM.straggler_own_ratio),
    "peak_memory": ("memory", SM.peak_memory_bytes),
    SM.moe_maxvio: ("expert balance", SM.moe_maxvio),
    SM.media_scale: ("layers", SM.media_scale),
    "residual_scale": ("layers", SM.residual_ratio_min),
    SM.clip_rate: ("gradient", SM.clip_rate),
    "vanishing_gradients": ("gradient", SM.grad_norm),
    SM.compute_rate: ("step time", SM.compute_rate),
    SM.memory_headroom: ("memory", SM.peak_memory_bytes),
    SM.moe_shard_imbalance: ("expert balance", SM.moe_shard_imbalance),
    SM.moe_h_norm: ("expert balance", SM.moe_h_norm),
    SM.modality_token_share: ("layers", SM.modality_token_share),
}
_NON_PAGING_KINDS = {"gap", "via_rank"}  # anomalies of a paging signal that never page


@dataclass(frozen=True, slots=True)
class _Score:
    baseline: float | None
    z: float | None
    ratio: float | None
    moved: bool
    onset: int | None
    at: int | None  # the step the value, baseline and z describe


def _trend(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Theil–Sen line through (x, y): median pairwise slope, then the median intercept."""
    if x.size < 2:
        return 0.0, float(np.median(y))
    dx = x[None, :] - x[:, None]
    dy = y[None, :] - y[:, None]
    upper = dx > 0
    slope = float(np.median(dy[upper] / dx[upper])) if upper.any() else 0.0
    return slope, float(np.median(y - slope * x))


def _score(
    hist_steps: np.ndarray,
    hist: np.ndarray,
    scan_steps: np.ndarray,
    scan: np.ndarray,
    *,
    log: bool,
    min_change: float,
    z_threshold: float,
    trend_window: int | None,
    min_history: int = 5,
) -> _Score:
    """Score the scanned values against the history (see the module docstring).

    With ``trend_window`` the baseline follows the Theil–Sen line of the last
    ``trend_window`` history points; without it, it is their plain median. Reports the
    last scanned step, or the step that moved most when the signal has come back by then.
    A non-finite scanned value has moved (z = inf).
    """
    ok = np.isfinite(hist) & ((hist > -_EPS) if log else True)
    hs, hv = hist_steps[ok], hist[ok]
    if hv.size < min_history or scan.size == 0:
        return _Score(None, None, None, False, None, None)
    u = np.log(hv + _EPS) if log else hv
    if trend_window:
        hs, u = hs[-trend_window:], u[-trend_window:]
        slope, intercept = _trend(hs.astype(np.float64), u)
    else:
        slope, intercept = 0.0, float(np.median(u))
    _, mad = median_mad(u - (intercept + slope * hs))
    scored: list[tuple[int, float, float, float, bool]] = []  # step, value, baseline, z, moved
    for s, v in zip(scan_steps, scan):
        level = intercept + slope * float(s)
        base = math.exp(level) - _EPS if log else level
        if not math.isfinite(v):
            scored.append((int(s), float(v), base, math.inf, True))
            continue
        v = float(v)
        w = math.log(max(v, 0.0) + _EPS) if log else v
        z = robust_z(w - level, mad, spread_floor(level, log=log))
        change = (v / base - 1.0) if (log and base > 0) else (v - base)
        scored.append((int(s), float(v), base, z, z >= z_threshold and change >= min_change))
    pick = len(scored) - 1
    if not scored[pick][4] and any(t[4] for t in scored):
        pick = max((i for i, t in enumerate(scored) if t[4]), key=lambda i: scored[i][3])
    start = pick  # the onset of the episode the picked step belongs to
    while start > 0 and scored[start - 1][4]:
        start -= 1
    onset = scored[start][0] if scored[pick][4] else None
    s, value, base, z, _moved = scored[pick]
    ratio = value / base if math.isfinite(value) and base > 0 else None
    return _Score(base, z, ratio, onset is not None, onset, s)


@dataclass
class _Walk:
    """One explain walk: the loaded data, the scanned and history steps, the thresholds,
    and the findings so far; each stage of the escalation order is one method."""

    ld: Loaded
    trend_window: int
    z_threshold: float
    min_change: float
    jump_ratio: float
    min_history: int
    findings: list[Finding] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.data, self.step = self.ld.data, self.ld.step
        self.hist, self.scan = self.data.steps < self.ld.start, self.data.steps >= self.ld.start

    def col(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self.data.series(name), self.data.present(name)

    def scored(
        self,
        stage: str,
        signal: str,
        values: np.ndarray,
        present: np.ndarray,
        *,
        log: bool = True,
        change: float | None = None,
        culprit: str | None = None,
        note: str = "",
        shown: np.ndarray | None = None,
        falls: bool = False,
        history: int | None = None,
    ) -> Finding | None:
        """Score one series; None when it was not measured in the scanned steps.
        ``falls``: the signal is worse when it falls, so 1/x is scored (x is reported)."""
        data = self.data
        h, sc_ = self.hist & present, self.scan & present
        if not sc_.any():
            return None
        score_on = 1.0 / values if falls else values
        sc = _score(
            data.steps[h],
            score_on[h],
            data.steps[sc_],
            score_on[sc_],
            log=log,
            min_change=self.min_change if change is None else change,
            z_threshold=self.z_threshold,
            trend_window=self.trend_window if log and shown is None and not falls else None,
            min_history=self.min_history if history is None else history,
        )
        at = sc.at if sc.at is not None else int(data.steps[sc_][-1])
        i = int(np.flatnonzero(data.steps == at)[0])
        value, baseline = float(values[i]), sc.baseline
        if falls:
            baseline = 1.0 / baseline if baseline else None
            sc = replace(sc, ratio=value / baseline if baseline else None)
        if shown is not None:  # report the signal itself, scored through a ratio
            value = float(shown[i])
            baseline = value / sc.ratio if sc.ratio else None
        if at != self.step:
            note = "; ".join(n for n in (f"value at step {at}", note) if n)
        finding = Finding(
            stage, signal, value, baseline, sc.ratio, sc.z, culprit, sc.moved, sc.onset, note, at
        )
        self.findings.append(finding)
        return finding

    def job_state(self) -> None:
        """1. Job state: missing ranks, incomplete steps, late data, replays."""
        data, step, scan = self.data, self.step, self.scan
        in_scan = [
            (int(s), m)
            for s, m, keep in zip(data.steps, data.column(SM.ranks_missing), scan)
            if keep
        ]
        missing = {s: m for s, m in in_scan if m}
        ranks = sorted({r for m in missing.values() for r in m})
        note = (
            f"ranks missing on {len(missing)} of {len(in_scan)} scanned steps"
            if missing
            else "every rank reported"
        )
        self.findings.append(
            Finding(
                "job state",
                SM.ranks_missing,
                float(len(data.at(SM.ranks_missing, step))),
                0.0,
                None,
                None,
                f"ranks {', '.join(map(str, ranks))}" if ranks else None,
                bool(missing),
                min(missing) if missing else None,
                note,
                step,
            )
        )
        reasons = {
            int(s): r
            for s, r, keep in zip(data.steps, data.column(SM.complete_reason), scan)
            if keep and r not in (CompleteReason.ALL_RANKS, "", None)
        }
        if reasons:
            what = ", ".join(f"step {s}: {r}" for s, r in sorted(reasons.items()))
            self.findings.append(
                Finding(
                    "job state", SM.complete_reason, float(len(reasons)), 0.0, None, None,
                    None, True, min(reasons), what, step,
                )
            )  # fmt: skip
        self._late_and_counters()

    def _late_and_counters(self) -> None:
        data, step, ld = self.data, self.step, self.ld
        if ld.late:
            late_ranks = sorted({r for _, rs in ld.late for r in rs})
            self.findings.append(
                Finding(
                    "job state", "late_data", float(len(ld.late)), 0.0, None, None,
                    f"ranks {', '.join(map(str, late_ranks))}", True, ld.late[0][0],
                    "rank data arrived after its step was reduced", step,
                )
            )  # fmt: skip
        scan_steps = data.steps[self.scan]
        for counter in (SM.replay_mismatch, SM.skipped, SM.replayed):
            values = data.series(counter)
            before = values[self.hist][-1] if self.hist.any() else 0.0
            grew = [int(s) for s, v in zip(scan_steps, values[self.scan]) if v > before]
            if grew:
                self.findings.append(
                    Finding(
                        "job state", counter, float(values[-1]), float(before), None, None,
                        None, True, grew[0], f"+{values[-1] - before:.0f} in the scanned steps",
                        step,
                    )
                )  # fmt: skip

    def loss(self) -> None:
        """2. Loss: L, the worst rank's gap L_max / L, each source against its own history."""
        data, ld = self.data, self.ld
        loss, has_loss = self.col(SM.loss)
        gap = data.series(SM.loss_worst_rank) / loss
        has_gap = has_loss & data.present(SM.loss_worst_rank)
        worst_rank = data.at(SM.loss_worst_rank_id, self.step)
        rank_culprit = None if worst_rank is None else f"rank {worst_rank}"
        loss_finding = self.scored("loss", SM.loss, loss, has_loss)
        gap_finding = self.scored(
            "loss",
            SM.loss_worst_rank,
            gap,
            has_gap,
            culprit=rank_culprit,
            shown=data.series(SM.loss_worst_rank),
            note="scored as L_max / L against its own history",
        )
        source_findings = _sources(
            ld, self.hist, self.scan, loss, self.z_threshold, self.min_change, self.min_history
        )
        self.findings.extend(source_findings)
        carrier = (
            rank_culprit
            if gap_finding is not None and gap_finding.moved
            else next(
                (f.culprit for f in sorted(source_findings, key=lambda f: -f.size) if f.moved),
                None,
            )
        )
        if loss_finding is not None and carrier:
            self.findings[self.findings.index(loss_finding)] = replace(
                loss_finding, culprit=carrier
            )

    def gradient(self, layer_culprit: str | None) -> None:
        """3. Gradient norm, clipping, co-spikes, output |x|max."""
        data, hist, scan = self.data, self.hist, self.scan
        self.scored(
            "gradient", SM.grad_norm, *self.col(SM.grad_norm), change=0.05, culprit=layer_culprit
        )
        self.scored("gradient", SM.clip_rate, *self.col(SM.clip_rate), log=False, change=0.02)
        scan_steps = data.steps[scan]
        cospikes = [int(s) for s, c in zip(scan_steps, data.series(SM.cospike)[scan]) if c > 0]
        count = data.series(SM.cospike_count)
        if cospikes or np.isfinite(count).any():
            self.findings.append(
                Finding(
                    "gradient",
                    SM.cospike_count,
                    float(count[-1]),
                    float(count[hist][-1]) if hist.any() else 0.0,
                    None,
                    None,
                    layer_culprit if cospikes else None,
                    bool(cospikes),
                    cospikes[0] if cospikes else None,
                    f"co-spikes at steps {cospikes}" if cospikes else "",
                    cospikes[-1] if cospikes else self.step,
                )
            )
        self.scored(
            "gradient",
            SM.output_absmax,
            *self.col(SM.output_absmax),
            change=0.1,
            culprit=layer_culprit,
        )

    def step_time_and_memory(self) -> None:
        """4. Step time: the straggler; 5. memory: the peak rank and its growth."""
        data, step = self.data, self.step
        straggler = data.at(SM.straggler_rank, step)
        who = None if straggler is None else f"rank {straggler}"
        self.scored(
            "step time",
            SM.step_time_s,
            *self.col(SM.step_time_s),
            change=0.05,
            culprit=who,
            note=_rank_note(self.ld),
        )
        self.scored(
            "step time", SM.straggler_score, *self.col(SM.straggler_score), change=0.05, culprit=who
        )
        self.scored(
            "step time",
            SM.straggler_own_ratio,
            *self.col(SM.straggler_own_ratio),
            change=0.05,
            culprit=who,
            note="own time (step time - collective wait) over the other ranks'",
        )
        peak = data.series(SM.peak_memory_bytes)
        peak_rank = data.at(SM.peak_memory_rank, step)
        growth = ""
        if np.isfinite(peak).sum() >= 2:
            first = peak[np.isfinite(peak)][0]
            growth = f"{100 * (peak[-1] / first - 1):+.1f}% over steps {data.steps[0]}–{step}"
        self.scored(
            "memory",
            SM.peak_memory_bytes,
            *self.col(SM.peak_memory_bytes),
            change=0.02,
            culprit=None if peak_rank is None else f"rank {peak_rank}",
            note=growth,
        )

    def experts(self) -> None:
        """6. Expert balance: the worst layer and its busiest expert."""
        moe_culprit = None
        if self.ld.moe is not None:
            s, layer_name, _vio, expert, _h = self.ld.moe
            where = f"layer {layer_name}" if str(layer_name).isdigit() else layer_name
            moe_culprit = f"expert {expert} of {where} (step {s})"
        self.scored(
            "expert balance",
            SM.moe_maxvio,
            *self.col(SM.moe_maxvio),
            log=False,
            change=0.1,
            culprit=moe_culprit,
        )

    def layers(self, layer: Finding | None) -> None:
        """7. Layer views: the media scale γ and the weakest residual branch R_b (P0 at the
        structure probes' cadence, so few history points), both worse when they fall; then
        the backward walk."""
        data = self.data
        self.scored(
            "layers",
            SM.media_scale,
            *self.col(SM.media_scale),
            falls=True,
            change=0.5,
            culprit="media projector",
            history=3,
        )
        ratio, has_ratio = self.col(SM.residual_ratio_min)
        residual = self.scored(
            "layers", SM.residual_ratio_min, ratio, has_ratio, falls=True, change=0.5, history=3
        )
        if residual is not None and residual.moved:
            cause = _residual_cause(
                self.ld, self.hist & has_ratio, int(data.steps[has_ratio][-1]), self.jump_ratio
            )
            self.findings[self.findings.index(residual)] = replace(residual, culprit=cause)
        if layer is not None:
            self.findings.append(layer)


def score(
    ld: Loaded,
    *,
    trend_window: int = 20,
    z_threshold: float = 6.0,
    min_change: float = 0.02,
    jump_ratio: float = 3.0,
    min_history: int = 20,
) -> Explanation:
    """Walk the escalation order over ``ld`` (see the module docstring)."""
    walk = _Walk(ld, trend_window, z_threshold, min_change, jump_ratio, min_history)
    walk.job_state()
    walk.loss()
    layer = _layers(ld, ld.start, jump_ratio)
    walk.gradient(layer.culprit if layer is not None and layer.moved else None)
    walk.step_time_and_memory()
    walk.experts()
    walk.layers(layer)
    tokens = ld.data.at("tokens", ld.step)
    findings = walk.findings
    return Explanation(
        ld.run_id, ld.step, int(tokens or 0), ld.start, tuple(findings), _pages(ld, findings)
    )


def _pages(ld: Loaded, findings: list[Finding]) -> tuple[Page, ...]:
    """The page records at the step, then events at the step inside an earlier page's
    episode; in the escalation order, larger moves first within a stage."""
    names = {f.signal for f in findings}

    def page(row: dict, episode_step: int | None) -> Page:
        stage, finding = PAGE_FINDINGS.get(row["signal"], ("layers", None))
        if finding is not None and "{source}" in finding:
            finding = finding.format(source=row["culprit"].removeprefix("source "))
        if row["signal"] == "step_time" and SM.straggler_own_ratio not in names:
            finding = SM.step_time_s
        return Page(
            stage,
            row["signal"],
            row["culprit"],
            row["value"],
            row["baseline"],
            row["z"],
            row.get("message") or "",
            finding if finding in names else None,
            episode_step,
        )

    pages = [page(row, None) for row in ld.alerts]
    paged = {(p.signal, p.culprit) for p in pages}
    pages += [
        page(row, int(row["page_step"]))
        for row in ld.episode_events
        if row["kind"] not in _NON_PAGING_KINDS
        and (row["signal"], row["culprit"]) not in paged
        and not (row["signal"] in (SM.loss, SM.grad_norm) and row["kind"] != "nonfinite")
    ]
    return tuple(
        sorted(
            pages,
            key=lambda p: (
                p.episode_step is not None,
                STAGES.index(p.stage),
                -(abs(p.z) if p.z is not None else math.inf),
            ),
        )
    )


def _sources(
    ld: Loaded,
    hist: np.ndarray,
    scan: np.ndarray,
    loss: np.ndarray,
    z_threshold: float,
    min_change: float,
    min_history: int,
) -> list[Finding]:
    data = ld.data
    index = {int(s): i for i, s in enumerate(data.steps)}
    by_source: dict[str, np.ndarray] = {}
    for source, s, value in ld.sources:
        series = by_source.setdefault(source, np.full(data.steps.size, np.nan))
        if s in index:
            series[index[s]] = value
    out = []
    for source, values in by_source.items():
        if not np.isfinite(values[scan]).any():
            continue
        ratio = values / loss
        sc = _score(
            data.steps[hist],
            ratio[hist],
            data.steps[scan],
            ratio[scan],
            log=True,
            min_change=min_change,
            z_threshold=z_threshold,
            trend_window=None,
            min_history=min_history,
        )
        at = sc.at if sc.at is not None else ld.step
        value = float(values[int(np.flatnonzero(data.steps == at)[0])])
        baseline = value / sc.ratio if sc.ratio else None
        out.append(
            Finding(
                "loss",
                f"source:{source}",
                value,
                baseline,
                sc.ratio,
                sc.z,
                f"source {source}",
                sc.moved,
                sc.onset,
                "scored as L_source / L against its own history",
                at,
            )
        )
    return sorted(out, key=lambda f: -(f.z if f.z is not None and math.isfinite(f.z) else 1e300))


def _residual_cause(ld: Loaded, hist: np.ndarray, step: int, jump_ratio: float) -> str:
    """Tell a growing residual stream from a shrinking branch (seeds 001 §8): the weakest
    branch's stream norm N_s and branch norm N_b at ``step`` (its latest measurement)
    against their history medians."""
    data = ld.data
    branch = data.at(SM.residual_ratio_branch, step) or "the weakest branch"

    def change(name: str) -> float:
        """value at ``step`` / history median; NaN when either is missing."""
        series = data.series(name)
        past = series[hist & np.isfinite(series)]
        base = float(np.median(past)) if past.size else math.nan
        return float(series[data.steps == step][0]) / base if base > 0 else math.nan

    grew, kept = change(SM.residual_stream_norm), change(SM.residual_branch_norm)
    if grew >= jump_ratio:
        return f"{branch}: residual stream grew {grew:.3g}×"
    if kept <= 1.0 / jump_ratio:
        return f"{branch}: branch shrank {kept:.3g}×"
    return branch


def _rank_note(ld: Loaded) -> str:
    """The slowest rank by its own time, as stage 2 names the straggler (the stream's
    ``derive.own_times``: step time minus the collective wait the rank reported, clamped
    into the step, floored), against the other ranks' median own time. Under synchronous
    DDP the waiting ranks' step times carry the straggler's delay too, so the step time
    alone does not tell them apart."""
    if len(ld.step_times) < 2:
        return ""
    own = own_times(ld.step_times, ld.waits)
    if len(own) < 2:
        return ""
    slowest = max(sorted(own), key=own.__getitem__)
    ratio = own_time_ratios(own)[slowest]
    if not ld.waits:
        return f"rank {slowest} at {own[slowest]:.4g}, {ratio:.2f}× the other ranks' median"
    return (
        f"rank {slowest}: own time {own[slowest]:.4g} s (step "
        f"{ld.step_times[slowest]:.4g} s - collective wait "
        f"{ld.waits.get(slowest, 0.0):.4g} s), {ratio:.2f}× the other ranks' median own "
        "time"
    )


def _depth(tensor: str) -> float:
    """Position from the input (embeddings, positional ones included: -1) to the output
    (+inf), with the layer naming rules the rank-side localisation uses."""
    return layer_of_tensor(tensor)[0]


def _layers(ld: Loaded, start: int, jump_ratio: float) -> Finding | None:
    """Walk backward |g|max from the output inward; the first layer that jumps is named."""
    if ld.tensor_kind is None or not ld.tensors:
        return None
    kind, steps = ld.tensor_kind, ld.tensor_steps
    values: dict[str, dict[int, float]] = {}
    for tensor, s, v in ld.tensors:
        values.setdefault(tensor, {})[s] = v

    def jumps(at: int) -> list[tuple[float, str, float, float]]:
        out = []
        for tensor, series in values.items():
            past = [v for s, v in series.items() if s < at and math.isfinite(v)]
            if at in series and past:
                base = float(np.median(past))
                ratio = series[at] / base if base > 0 else math.inf
                out.append((_depth(tensor), tensor, ratio, base))
        return sorted(out, key=lambda t: (-t[0], t[1]))

    def origin(at: int) -> tuple[float, str, float, float] | None:
        walk = jumps(at)
        for depth, _tensor, ratio, _base in walk:  # from the output inward
            if not math.isfinite(ratio) or ratio >= jump_ratio:
                layer = [t for t in walk if t[0] == depth]
                return max(layer, key=lambda t: t[2] if math.isfinite(t[2]) else math.inf)
        return None

    latest = max(steps)
    found = origin(latest)
    # the onset: the first scanned tensor step from which the walk names the same layer on
    # every step up to the latest (an earlier blip that came back is another episode)
    onset = None
    if found is not None:
        for s in sorted((s for s in steps if s >= start), reverse=True):
            at = origin(s)
            if at is None or at[0] != found[0]:
                break
            onset = s
    if found is None:
        walk = jumps(latest)
        top = max(walk, key=lambda t: t[2]) if walk else None
        return Finding(
            "layers",
            f"{kind} |g|max",
            None if top is None else values[top[1]][latest],
            None if top is None else top[3],
            None if top is None else top[2],
            None,
            None,
            False,
            None,
            f"no layer jumped ≥{jump_ratio:g}× its own history at step {latest}",
            latest,
        )
    depth, tensor, ratio, base = found
    name = "output" if depth == math.inf else "embeddings" if depth < 0 else f"layer {int(depth)}"
    return Finding(
        "layers",
        f"{kind} |g|max",
        values[tensor][latest],
        base,
        ratio,
        None,
        f"{name} ({tensor})",
        True,
        onset,
        f"first jump walking from the output inward, tensor_stats step {latest}",
        latest,
    )
