"""``probewire explain``: what moved at one step, in the escalation order, and who carries it.

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
* z = 0.6745 (u - baseline) / MAD of the history's residuals, as the stream's detector;
* moved: z ≥ ``z_threshold`` and the value differs from the baseline by at least
  ``min_change`` (relative), upward (every signal here is worse when it rises);
* onset: the first step of the episode the reported step belongs to (the run of
  consecutive moved scanned steps that ends there), so an earlier blip that came back is
  not taken for the start of the present one.

Loss by source is the ratio L_source / L against that ratio's own history (absolute
levels differ between sources, and the ratio removes the trend all sources share); the
worst rank is the gap L_max / L. The signal with the earliest onset moved first (ties go
to the earlier stage of the escalation order).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from probewire.stream.localize import layer_of_tensor

__all__ = ["Explanation", "Finding", "StepNotFound", "STAGES", "explain", "render"]

STAGES = ("job state", "loss", "gradient", "step time", "memory", "expert balance", "layers")
_EPS = 1e-8
_LINEAR_MAD_FLOOR = 1e-3  # fractions (clip rate, MaxVio) that sit at exactly 0 for a while


class StepNotFound(LookupError):
    """The run or the step is not in the store."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One signal at the explained step, against its own baseline."""

    stage: str
    signal: str
    value: float | None
    baseline: float | None
    ratio: float | None           # value / baseline
    z: float | None               # robust score against the signal's own history
    culprit: str | None           # "rank 3", "source code", "layer 2 (layers.2.mlp)", ...
    moved: bool
    onset_step: int | None = None  # first step of the scanned stretch at which it had moved
    note: str = ""


@dataclass(frozen=True, slots=True)
class Explanation:
    run_id: str
    step: int
    tokens: int
    scanned_from: int
    findings: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def moved(self) -> list[Finding]:
        """Findings that moved, earliest onset first (ties: escalation order)."""
        order = {id(f): i for i, f in enumerate(self.findings)}
        return sorted((f for f in self.findings if f.moved),
                      key=lambda f: (f.onset_step if f.onset_step is not None else self.step,
                                     order[id(f)]))

    @property
    def first(self) -> Finding | None:
        moved = self.moved
        return moved[0] if moved else None

    def headline(self) -> str:
        f = self.first
        if f is None:
            return (f"Nothing moved against its own baseline in steps {self.scanned_from}–"
                    f"{self.step}; open the layer views (tensor_view) next.")
        when = f"step {f.onset_step}" if f.onset_step is not None else f"step {self.step}"
        if f.onset_step is not None and f.onset_step < self.step:
            gap = self.step - f.onset_step
            when += f" ({gap} step{'s' if gap > 1 else ''} before {self.step})"
        if f.onset_step == self.scanned_from:
            when = "at or before " + when
        size = _fmt(f.value)
        if f.baseline is not None:
            size += f" vs baseline {_fmt(f.baseline)}"
        extras = [f"×{f.ratio:.3g}" if f.ratio is not None else "",
                  f"z={f.z:.1f}" if f.z is not None and math.isfinite(f.z) else ""]
        extras = [e for e in extras if e]
        if extras:
            size += f" ({', '.join(extras)})"
        who = f"; carried by {f.culprit}" if f.culprit else ""
        return f"{f.signal} ({f.stage}) moved first, {when}: {size}{who}."


def _fmt(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.4g}" if math.isfinite(v) else str(v)


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


def _score(hist_steps: np.ndarray, hist: np.ndarray, scan_steps: np.ndarray, scan: np.ndarray,
           *, log: bool, min_change: float, z_threshold: float, trend_window: int | None,
           min_history: int = 5) -> _Score:
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
    resid = u - (intercept + slope * hs)
    mad = float(np.median(np.abs(resid - np.median(resid))))
    if not log:
        mad = max(mad, _LINEAR_MAD_FLOOR)
    scored: list[tuple[int, float, float, float, bool]] = []  # step, value, baseline, z, moved
    for s, v in zip(scan_steps, scan):
        level = intercept + slope * float(s)
        base = math.exp(level) - _EPS if log else level
        if not math.isfinite(v):
            scored.append((int(s), float(v), base, math.inf, True))
            continue
        v = float(v)
        w = math.log(max(v, 0.0) + _EPS) if log else v
        z = 0.6745 * (w - level) / (mad + _EPS)
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


@dataclass(slots=True)
class _Data:
    steps: np.ndarray
    cols: dict[str, list[Any]]

    def column(self, name: str) -> list[Any]:
        """A step_metrics column; one a store of an older schema lacks reads as not measured
        (explain reads, it never migrates)."""
        return self.cols.get(name) or [None] * self.steps.size

    def series(self, name: str) -> np.ndarray:
        """Values as floats; absent (not measured) is NaN, see ``present``."""
        return np.array([np.nan if v is None else float(v) for v in self.column(name)])

    def present(self, name: str) -> np.ndarray:
        return np.array([v is not None for v in self.column(name)], dtype=bool)

    def at(self, name: str, step: int) -> Any:
        return self.column(name)[int(np.flatnonzero(self.steps == step)[0])]


def _load(client: Any, sql: str, params: dict[str, Any]) -> tuple[list[str], list[tuple]]:
    result = client.query(sql, parameters=params)
    return list(result.column_names), list(result.result_rows)


def _depth(tensor: str) -> float:
    """Position from the input (embeddings, positional ones included: -1) to the output
    (+inf), with the layer naming rules the rank-side localisation uses."""
    return layer_of_tensor(tensor)[0]


def explain(client: Any, database: str, run_id: str, step: int, *, window: int = 50,
            trend_window: int = 20, lookback: int = 10, z_threshold: float = 6.0,
            min_change: float = 0.02, jump_ratio: float = 3.0,
            layer_history: int = 10, min_history: int = 20) -> Explanation:
    """Walk the escalation order for ``step`` of ``run_id`` (see the module docstring)."""
    db, p = database, {"run": run_id, "lo": max(step - lookback - window, 0), "hi": step}
    names, rows = _load(client, f"SELECT * FROM {db}.step_metrics FINAL WHERE run_id = "
                                "{run:String} AND step BETWEEN {lo:UInt64} AND {hi:UInt64} "
                                "ORDER BY step", p)
    if not rows or rows[-1][names.index("step")] != step:
        span = client.query(f"SELECT min(step), max(step), count() FROM {db}.step_metrics "
                            "WHERE run_id = {run:String}", parameters=p).result_rows[0]
        where = (f"it has steps {span[0]}–{span[1]}" if span[2] else "no such run")
        raise StepNotFound(f"step {step} of run {run_id!r} is not in {db}.step_metrics ({where})")
    data = _Data(np.array([r[names.index("step")] for r in rows]),
                 {n: [r[i] for r in rows] for i, n in enumerate(names)})
    start = max(step - lookback, int(data.steps[0]))
    hist, scan = data.steps < start, data.steps >= start
    findings: list[Finding] = []

    def col(name: str) -> tuple[np.ndarray, np.ndarray]:
        return data.series(name), data.present(name)

    def scored(stage: str, signal: str, values: np.ndarray, present: np.ndarray, *,
               log: bool = True, change: float = min_change, culprit: str | None = None,
               note: str = "", shown: np.ndarray | None = None, falls: bool = False,
               history: int = min_history) -> Finding | None:
        """Score one series; None when it was not measured in the scanned steps.
        ``falls``: the signal is worse when it falls, so 1/x is scored (x is reported)."""
        h, sc_ = hist & present, scan & present
        if not sc_.any():
            return None
        score_on = 1.0 / values if falls else values
        sc = _score(data.steps[h], score_on[h], data.steps[sc_], score_on[sc_], log=log,
                    min_change=change, z_threshold=z_threshold,
                    trend_window=trend_window if log and shown is None and not falls else None,
                    min_history=history)
        at = sc.at if sc.at is not None else int(data.steps[sc_][-1])
        i = int(np.flatnonzero(data.steps == at)[0])
        value, baseline = float(values[i]), sc.baseline
        if falls:
            baseline = 1.0 / baseline if baseline else None
            sc = replace(sc, ratio=value / baseline if baseline else None)
        if shown is not None:  # report the signal itself, scored through a ratio
            value = float(shown[i])
            baseline = value / sc.ratio if sc.ratio else None
        if at != step:
            note = "; ".join(n for n in (f"value at step {at}", note) if n)
        finding = Finding(stage, signal, value, baseline, sc.ratio, sc.z, culprit, sc.moved,
                          sc.onset, note)
        findings.append(finding)
        return finding

    # 1. Job state: missing ranks, incomplete steps, late data, replays.
    scan_steps = data.steps[scan]
    in_scan = [(int(s), m) for s, m, keep in zip(data.steps, data.cols["ranks_missing"], scan)
               if keep]
    missing = {s: m for s, m in in_scan if m}
    ranks = sorted({r for m in missing.values() for r in m})
    findings.append(Finding(
        "job state", "ranks_missing", float(len(data.at("ranks_missing", step))), 0.0, None,
        None, f"ranks {', '.join(map(str, ranks))}" if ranks else None, bool(missing),
        min(missing) if missing else None,
        f"ranks missing on {len(missing)} of {len(in_scan)} scanned steps" if missing
        else "every rank reported"))
    reasons = {int(s): r for s, r, keep in zip(data.steps, data.cols["complete_reason"], scan)
               if keep and r not in ("all_ranks", "")}
    if reasons:
        findings.append(Finding("job state", "complete_reason", float(len(reasons)), 0.0, None,
                                None, None, True, min(reasons),
                                ", ".join(f"step {s}: {r}" for s, r in sorted(reasons.items()))))
    late = _load(client, f"SELECT step, groupUniqArray(rank) FROM {db}.rank_metrics FINAL "
                         "WHERE run_id = {run:String} AND late = 1 AND step BETWEEN "
                         "{lo:UInt64} AND {hi:UInt64} GROUP BY step ORDER BY step",
                 p | {"lo": start})[1]
    if late:
        late_ranks = sorted({r for _, rs in late for r in rs})
        findings.append(Finding("job state", "late_data", float(len(late)), 0.0, None, None,
                                f"ranks {', '.join(map(str, late_ranks))}", True, int(late[0][0]),
                                "rank data arrived after its step was reduced"))
    for counter in ("replay_mismatch", "skipped", "replayed"):
        values = data.series(counter)
        before = values[hist][-1] if hist.any() else 0.0
        grew = [int(s) for s, v in zip(scan_steps, values[scan]) if v > before]
        if grew:
            findings.append(Finding("job state", counter, float(values[-1]), float(before),
                                    None, None, None, True, grew[0],
                                    f"+{values[-1] - before:.0f} in the scanned steps"))

    # 2. Loss: L, the worst rank's gap L_max / L, each source against its own history.
    loss, has_loss = col("loss")
    gap = data.series("loss_worst_rank") / loss
    has_gap = has_loss & data.present("loss_worst_rank")
    worst_rank = data.at("loss_worst_rank_id", step)
    rank_culprit = None if worst_rank is None else f"rank {worst_rank}"
    loss_finding = scored("loss", "loss", loss, has_loss)
    gap_finding = scored("loss", "loss_worst_rank", gap, has_gap, culprit=rank_culprit,
                         shown=data.series("loss_worst_rank"),
                         note="scored as L_max / L against its own history")
    source_findings = _sources(client, db, p, data, hist, scan, loss, z_threshold, min_change,
                               min_history)
    findings.extend(source_findings)
    carrier = (rank_culprit if gap_finding is not None and gap_finding.moved else
               next((f.culprit for f in sorted(source_findings, key=lambda f: -(f.z or 0))
                     if f.moved), None))
    if loss_finding is not None and carrier:
        findings[findings.index(loss_finding)] = replace(loss_finding, culprit=carrier)

    # 3. Gradient norm, clipping, co-spikes, output |x|max.
    layer = _layers(client, db, run_id, step, start, jump_ratio, layer_history)
    layer_culprit = layer.culprit if layer is not None and layer.moved else None
    scored("gradient", "grad_norm", *col("grad_norm"), change=0.05, culprit=layer_culprit)
    scored("gradient", "clip_rate", *col("clip_rate"), log=False, change=0.02)
    cospikes = [int(s) for s, c in zip(scan_steps, data.series("cospike")[scan]) if c > 0]
    count = data.series("cospike_count")
    if cospikes or np.isfinite(count).any():
        findings.append(Finding("gradient", "cospike_count", float(count[-1]),
                                float(count[hist][-1]) if hist.any() else 0.0, None, None,
                                layer_culprit if cospikes else None, bool(cospikes),
                                cospikes[0] if cospikes else None,
                                f"co-spikes at steps {cospikes}" if cospikes else ""))
    scored("gradient", "output_absmax", *col("output_absmax"), change=0.1,
           culprit=layer_culprit)

    # 4. Step time: the straggler; 5. memory: the peak rank and its growth.
    straggler = data.at("straggler_rank", step)
    who = None if straggler is None else f"rank {straggler}"
    scored("step time", "step_time_s", *col("step_time_s"), change=0.05, culprit=who,
           note=_rank_note(client, db, run_id, step, "step_time_s"))
    scored("step time", "straggler_score", *col("straggler_score"), change=0.05,
           culprit=who)
    scored("step time", "straggler_own_ratio", *col("straggler_own_ratio"), change=0.05,
           culprit=who, note="own time (step time - collective wait) over the other ranks'")
    peak = data.series("peak_memory_bytes")
    peak_rank = data.at("peak_memory_rank", step)
    growth = ""
    if np.isfinite(peak).sum() >= 2:
        first = peak[np.isfinite(peak)][0]
        growth = f"{100 * (peak[-1] / first - 1):+.1f}% over steps {data.steps[0]}–{step}"
    scored("memory", "peak_memory_bytes", *col("peak_memory_bytes"), change=0.02,
           culprit=None if peak_rank is None else f"rank {peak_rank}", note=growth)

    # 6. Expert balance: the worst layer and its busiest expert.
    moe = _load(client, f"SELECT step, layer, max_violation, busiest_expert, h_norm FROM "
                        f"{db}.expert_balance WHERE run_id = {{run:String}} AND step <= "
                        "{hi:UInt64} AND step >= {lo:UInt64} ORDER BY step DESC, "
                        "max_violation DESC LIMIT 1", p | {"lo": start})[1]
    moe_culprit = None
    if moe:
        s, layer_name, _vio, expert, _h = moe[0]
        where = f"layer {layer_name}" if str(layer_name).isdigit() else layer_name
        moe_culprit = f"expert {expert} of {where} (step {s})"
    scored("expert balance", "moe_maxvio", *col("moe_maxvio"), log=False, change=0.1,
           culprit=moe_culprit)

    # 7. Layer views: the media scale γ and the weakest residual branch R_b (P0 at the
    # structure probes' cadence, so few history points), both worse when they fall; then
    # the backward walk.
    scored("layers", "media_scale", *col("media_scale"), falls=True, change=0.5,
           culprit="media projector", history=3)
    ratio, has_ratio = col("residual_ratio_min")
    residual = scored("layers", "residual_ratio_min", ratio, has_ratio, falls=True, change=0.5,
                      history=3)
    if residual is not None and residual.moved:
        findings[findings.index(residual)] = replace(
            residual, culprit=_residual_cause(data, hist & has_ratio,
                                              int(data.steps[has_ratio][-1]), jump_ratio))
    if layer is not None:
        findings.append(layer)
    tokens = data.at("tokens", step)
    return Explanation(run_id, step, int(tokens or 0), start, tuple(findings))


def _sources(client: Any, db: str, p: dict[str, Any], data: _Data, hist: np.ndarray,
             scan: np.ndarray, loss: np.ndarray, z_threshold: float,
             min_change: float, min_history: int) -> list[Finding]:
    rows = _load(client, f"SELECT source, step, loss FROM {db}.source_metrics FINAL "
                         "WHERE run_id = {run:String} AND step BETWEEN {lo:UInt64} AND "
                         "{hi:UInt64} ORDER BY source, step", p)[1]
    index = {int(s): i for i, s in enumerate(data.steps)}
    by_source: dict[str, np.ndarray] = {}
    for source, s, value in rows:
        series = by_source.setdefault(source, np.full(data.steps.size, np.nan))
        if int(s) in index:
            series[index[int(s)]] = value
    out = []
    for source, values in by_source.items():
        if not np.isfinite(values[scan]).any():
            continue
        ratio = values / loss
        sc = _score(data.steps[hist], ratio[hist], data.steps[scan], ratio[scan], log=True,
                    min_change=min_change, z_threshold=z_threshold, trend_window=None,
                    min_history=min_history)
        value = float(values[-1])
        baseline = value / sc.ratio if sc.ratio else None
        out.append(Finding("loss", f"source:{source}", value, baseline, sc.ratio, sc.z,
                           f"source {source}", sc.moved, sc.onset,
                           "scored as L_source / L against its own history"))
    return sorted(out, key=lambda f: -(f.z if f.z is not None and math.isfinite(f.z) else 1e300))


def _residual_cause(data: _Data, hist: np.ndarray, step: int, jump_ratio: float) -> str:
    """Tell a growing residual stream from a shrinking branch (seeds 001 §8): the weakest
    branch's stream norm N_s and branch norm N_b at ``step`` (its latest measurement)
    against their history medians."""
    branch = data.at("residual_ratio_branch", step) or "the weakest branch"

    def change(name: str) -> float:
        """value at ``step`` / history median; NaN when either is missing."""
        series = data.series(name)
        past = series[hist & np.isfinite(series)]
        base = float(np.median(past)) if past.size else math.nan
        return float(series[data.steps == step][0]) / base if base > 0 else math.nan

    grew, kept = change("residual_stream_norm"), change("residual_branch_norm")
    if grew >= jump_ratio:
        return f"{branch}: residual stream grew {grew:.3g}×"
    if kept <= 1.0 / jump_ratio:
        return f"{branch}: branch shrank {kept:.3g}×"
    return branch


def _rank_note(client: Any, db: str, run_id: str, step: int, metric: str) -> str:
    """The slowest rank by its own time, as stage 2 names the straggler: ``metric`` (the
    step time) minus the collective wait the rank reported (comm.wait_s, all ops), against
    the other ranks' median. Under synchronous DDP the waiting ranks' step times carry the
    straggler's delay too, so the step time alone does not tell them apart."""
    rows = _load(client, f"SELECT rank, metric, value FROM {db}.rank_metrics FINAL WHERE "
                         "run_id = {run:String} AND step = {s:UInt64} AND metric IN "
                         "({m:String}, 'comm.wait_s') ORDER BY rank",
                         {"run": run_id, "s": step, "m": metric})[1]
    taus = {int(r): v for r, name, v in rows if name == metric}
    waits: dict[int, float] = {}
    for r, name, v in rows:
        if name == "comm.wait_s" and math.isfinite(v):
            waits[int(r)] = waits.get(int(r), 0.0) + v
    if len(taus) < 2:
        return ""
    own = {r: max(t - waits[r], 0.0) if r in waits else t for r, t in taus.items()}
    slowest = max(sorted(own), key=own.__getitem__)
    others = float(np.median([v for r, v in own.items() if r != slowest]))
    ratio = f"{own[slowest] / others:.2f}×" if others > 0 else "far above"
    if not waits:
        return f"rank {slowest} at {own[slowest]:.4g}, {ratio} the other ranks' median"
    return (f"rank {slowest}: own time {own[slowest]:.4g} s (step {taus[slowest]:.4g} s - "
            f"collective wait {waits.get(slowest, 0.0):.4g} s), {ratio} the other ranks' "
            "median own time")


def _layers(client: Any, db: str, run_id: str, step: int, start: int, jump_ratio: float,
            history: int) -> Finding | None:
    """Walk backward |g|max from the output inward; the first layer that jumps is named."""
    p = {"run": run_id, "hi": step}
    kinds = _load(client, f"SELECT kind, max(step) FROM {db}.tensor_stats FINAL WHERE run_id = "
                          "{run:String} AND kind IN ('bwd', 'grad') AND step <= {hi:UInt64} "
                          "GROUP BY kind ORDER BY kind", p)[1]
    if not kinds:
        return None
    kind = "bwd" if any(k == "bwd" for k, _ in kinds) else "grad"
    steps = [r[0] for r in _load(client, f"SELECT DISTINCT step FROM {db}.tensor_stats WHERE "
                                         "run_id = {run:String} AND kind = {k:String} AND step "
                                         "<= {hi:UInt64} ORDER BY step DESC LIMIT {n:UInt32}",
                                 p | {"k": kind, "n": history + 1})[1]]
    rows = _load(client, f"SELECT tensor, step, abs_max FROM {db}.tensor_stats FINAL WHERE "
                         "run_id = {run:String} AND kind = {k:String} "
                         "AND step IN {s:Array(UInt64)}",
                 p | {"k": kind, "s": steps})[1]
    if not rows:
        return None
    values: dict[str, dict[int, float]] = {}
    for tensor, s, v in rows:
        values.setdefault(tensor, {})[int(s)] = float(v)

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
        return Finding("layers", f"{kind} |g|max", None if top is None else values[top[1]][latest],
                       None if top is None else top[3], None if top is None else top[2], None,
                       None, False, None,
                       f"no layer jumped ≥{jump_ratio:g}× its own history at step {latest}")
    depth, tensor, ratio, base = found
    name = "output" if depth == math.inf else "embeddings" if depth < 0 else f"layer {int(depth)}"
    return Finding("layers", f"{kind} |g|max", values[tensor][latest], base, ratio, None,
                   f"{name} ({tensor})", True, onset,
                   f"first jump walking from the output inward, tensor_stats step {latest}")


def render(explanation: Explanation, console: Any = None) -> None:
    """Print the walk as a rich table (moved rows in bold red), its notes and the headline."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"run {explanation.run_id}, step {explanation.step} "
                        f"({explanation.tokens:,} tokens); scanned steps "
                        f"{explanation.scanned_from}–{explanation.step}")
    for column in ("stage", "signal", "value", "baseline", "×", "z", "since", "culprit"):
        table.add_column(column, justify="right" if column in ("value", "baseline", "×", "z",
                                                                 "since") else "left")
    for f in explanation.findings:
        z = "" if f.z is None else ("inf" if not math.isfinite(f.z) else f"{f.z:.1f}")
        table.add_row(f.stage, f.signal, _fmt(f.value), _fmt(f.baseline),
                      "" if f.ratio is None else f"{f.ratio:.3g}", z,
                      "" if f.onset_step is None else str(f.onset_step), f.culprit or "",
                      style="bold red" if f.moved else None)
    console.print(table)
    for f in explanation.findings:
        if f.note and (f.moved or f.stage == "job state"):
            console.print(f"  {f.signal}: {f.note}")
    console.print(explanation.headline(), style="bold")
