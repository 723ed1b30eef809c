"""Stage 2: one run's reduced steps, in step order, become the rows people page on.

For each step: the P0 view (seeds 001 §1-§7) from the reduced components, cumulative
tokens and FLOPs, the detectors of ``signals``, anomaly and alert records, and the
retention decision for per-rank and P1/P2 detail. Detail is written for every step to
short-lived ``*_recent`` tables (the durable look-back buffer); steps the retention policy
keeps are promoted from there. The whole state serialises, so a restarted worker resumes
with no gap and no double count.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from probewire.instrument.catalog import Comm, Label, Loss, System

from .derive import (expert_balance, global_mean_loss, own_time_ratios, own_times,
                     rank_means, shard_imbalance, straggler_score, worst_rank_loss)
from .order import StepOrderer
from .records import ReducedStep, SeriesKey
from .retention import RetentionPolicy
from .pages import Episode
from .signals import DetectorConfig, Finding, RankSeries, SignalDetectors, next_steps

__all__ = ["RunPipeline", "Stage2Config", "Stage2Output", "p0_view"]

_TENSOR_FIELDS = ("n", "sum", "sum_sq", "abs_sum", "abs_max", "zeros", "nonfinite", "sum3", "sum4")


def _get(values: dict[SeriesKey, float], name: str, **labels: str) -> float | None:
    return values.get((name, tuple(sorted(labels.items()))))


def _labelled(values: dict[SeriesKey, float], name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in values.items() if n == name and labels}


def _per_rank(item: ReducedStep, name: str) -> dict[int, float]:
    return {r: v[(name, ())] for r, v in item.per_rank.items() if (name, ()) in v}


def _own_times(item: ReducedStep) -> dict[int, float]:
    """Per rank, its own time: step time minus the exposed collective wait it reported
    (``comm.wait_s``, summed over ops), the wait clamped into [0, step time] and the own
    time floored (``derive.own_times``).

    Under synchronous data parallelism every rank's step time carries the slowest rank's
    delay (the others wait for it in the gradient all-reduce); their own time does not."""
    taus = _per_rank(item, System.STEP_TIME)
    waits = {rank: math.fsum(v for (name, _), v in values.items()
                             if name == Comm.WAIT and math.isfinite(v))
             for rank, values in item.per_rank.items()}
    return own_times(taus, waits)


def _straggler(item: ReducedStep) -> tuple[int | None, float | None]:
    """The rank with the largest own time, and its own time / the median own time of the
    other ranks (leave-one-out; None with a single rank)."""
    own = _own_times(item)
    if not own:
        return None, None
    rank = max(sorted(own), key=own.__getitem__)  # ties: the lowest rank
    return rank, own_time_ratios(own).get(rank)


def _rank_series(item: ReducedStep, worst: int | None) -> RankSeries:
    """Each rank's local mean loss L_r and own-time ratio, and each source's loss over the
    ranks other than ``worst``, for the culprit rules."""
    sums: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, list[float]] = defaultdict(list)
    for rank, values in item.per_rank.items():
        if rank == worst:
            continue
        for (name, labels), value in values.items():
            source = dict(labels).get(Label.SOURCE) if name in (Loss.SUM, Loss.TOKENS) \
                else None
            if source is not None:
                (sums if name == Loss.SUM else counts)[source].append(value)
    return RankSeries(loss=rank_means(_per_rank(item, Loss.SUM), _per_rank(item, Loss.TOKENS)),
                      own_ratio=own_time_ratios(_own_times(item)),
                      source_loss_without_worst={  # sum, then divide (seeds 001 §3)
                          s: math.fsum(sums[s]) / math.fsum(counts[s]) for s in sums
                          if math.fsum(counts.get(s, ())) > 0})


def _moe(item: ReducedStep) -> dict[str, Any]:
    """MaxVio / shard imbalance / H_norm from per-expert valid-token counts c_i (seeds §7)."""
    layers: dict[str, dict[int, float]] = defaultdict(dict)
    for labels, count in _labelled(item.reduced, "moe.expert_tokens").items():
        lab = dict(labels)
        layers[lab["layer"]][int(lab["expert"])] = count
    out: dict[str, Any] = {"moe_maxvio": None, "moe_maxvio_layer": None,
                           "moe_shard_imbalance": None, "moe_h_norm": None}
    ep_size = len({r.get("ep", 0) for r in item.coords.values()}) if item.coords else 1
    for layer, by_expert in sorted(layers.items()):
        counts = [by_expert.get(i, 0.0) for i in range(max(by_expert) + 1)]
        balance = expert_balance(counts)
        if balance is None:  # no valid token reached the layer: no measurement
            continue
        if out["moe_maxvio"] is None or balance.max_violation > out["moe_maxvio"]:
            out["moe_maxvio"], out["moe_maxvio_layer"] = balance.max_violation, f"layer {layer}"
        if balance.entropy_norm is not None:
            out["moe_h_norm"] = balance.entropy_norm if out["moe_h_norm"] is None \
                else min(out["moe_h_norm"], balance.entropy_norm)
        if ep_size > 1 and len(counts) % ep_size == 0:
            per = len(counts) // ep_size
            shard = shard_imbalance(counts, [i // per for i in range(len(counts))])
            if shard is not None:
                out["moe_shard_imbalance"] = max(out["moe_shard_imbalance"] or 0.0, shard)
    return out


def _residual(item: ReducedStep) -> dict[str, Any]:
    """The weakest residual branch: the smallest token-mean R_b = Σ ratio_sum / Σ tokens over
    (layer, branch), with its mean stream norm N_s and branch norm N_b (seeds 001 §8)."""
    red = item.reduced
    weakest: tuple[float, tuple, float | None, float | None] | None = None
    for labels, n in _labelled(red, "residual.tokens").items():
        ratio = red.get(("residual.ratio_sum", labels))
        if not n > 0 or ratio is None or not math.isfinite(ratio):
            continue
        mean = ratio / n
        if weakest is None or mean < weakest[0]:
            norms = [red.get((f"residual.{stem}_sum", labels)) for stem in ("stream_norm",
                                                                             "branch_norm")]
            weakest = (mean, labels, *(None if v is None else v / n for v in norms))
    if weakest is None:
        return {"residual_ratio_min": None, "residual_ratio_branch": None,
                "residual_stream_norm": None, "residual_branch_norm": None}
    lab = dict(weakest[1])
    return {"residual_ratio_min": weakest[0],
            "residual_ratio_branch": f"layer {lab.get('layer', '?')} {lab.get('branch', '?')}",
            "residual_stream_norm": weakest[2], "residual_branch_norm": weakest[3]}


def p0_view(item: ReducedStep) -> tuple[dict[str, Any], dict[str, tuple[float, float, float]]]:
    """The step's P0 values from its reduced components, and per-source (loss, share, tokens)."""
    red = item.reduced
    tokens = _get(red, "loss.tokens") or 0.0
    sums, counts = _per_rank(item, "loss.sum"), _per_rank(item, "loss.tokens")
    ranks = sorted(set(sums) & set(counts))
    worst = worst_rank_loss([sums[r] for r in ranks], [counts[r] for r in ranks])
    grad_sq = _get(red, "grad.norm_sq")
    tau = _get(red, "step_time_s")
    straggler_rank, own_ratio = _straggler(item)
    taus = _per_rank(item, "step_time_s")
    flops = _get(red, "flops.step")
    memory = _per_rank(item, "memory.peak_allocated_bytes") or _per_rank(
        item, "memory.peak_rss_bytes")
    media = [_get(red, f"modality.{n}") for n in ("media_sum_sq", "media_n", "text_sum_sq",
                                                   "text_n")]
    view: dict[str, Any] = {
        "step_tokens": int(tokens),
        "loss": global_mean_loss([_get(red, "loss.sum") or 0.0], [tokens]),
        "loss_worst_rank": None if worst is None else worst[0],
        "loss_worst_rank_id": None if worst is None else ranks[worst[1]],
        "grad_norm": None if grad_sq is None else (math.sqrt(grad_sq) if grad_sq >= 0
                                                   else math.nan),
        "clipped": _get(red, "grad.clipped"),
        "step_time_s": tau,
        "tokens_per_s": tokens / tau if tau else None,
        "flops_step": flops,
        "compute_rate": flops / (item.world_size * tau) if flops is not None and tau else None,
        "straggler_score": straggler_score(list(taus.values())) if taus else None,
        "straggler_rank": straggler_rank,
        "straggler_own_ratio": own_ratio,
        "peak_memory_bytes": max(memory.values()) if memory else None,
        "peak_memory_rank": max(memory, key=memory.__getitem__) if memory else None,
        "output_absmax": _get(red, "output.logits_abs_max"),
        "media_scale": math.sqrt(media[0] / media[1]) / (math.sqrt(media[2] / media[3]) + 1e-12)
        if None not in media and media[1] and media[3] else None,
        "skipped": int(_get(red, "guard.skipped") or 0),
        "replayed": int(_get(red, "guard.replayed") or 0),
        "replay_mismatch": int(_get(red, "guard.replay_mismatch") or 0),
        "ranks_reporting": len(item.ranks_reporting),
        "ranks_missing": list(item.ranks_missing),
        "complete_reason": item.complete_reason,
        **_moe(item),
        **_residual(item),
    }
    sources = {}
    source_sums = _labelled(red, "loss.sum")
    for labels, count in _labelled(red, "loss.tokens").items():
        lab = dict(labels)
        if "source" in lab and count > 0 and labels in source_sums:
            sources[lab["source"]] = (source_sums[labels] / count,
                                      count / tokens if tokens else math.nan, count)
    return view, sources


def _detail_rows(item: ReducedStep) -> dict[str, list[dict[str, Any]]]:
    base = {"run_id": item.run_id, "step": item.step}
    run_id, step, late = item.run_id, item.step, int(item.complete_reason == "late")
    texts: dict[tuple, str] = {}  # every rank sends the same label sets: join each once
    for vals in item.per_rank.values():
        for _, lab in vals:
            if lab not in texts:
                texts[lab] = "|".join(f"{k}={v}" for k, v in lab)
    ranks = [{"run_id": run_id, "step": step, "rank": r, "metric": name, "labels": texts[lab],
              "value": value, "late": late}
             for r, vals in item.per_rank.items() for (name, lab), value in vals.items()]
    tensors: dict[tuple, dict[str, Any]] = {}
    experts = []
    for (name, labels), value in item.reduced.items():
        if name.startswith("tensor.") and name[7:] in _TENSOR_FIELDS:
            lab = dict(labels)
            row = tensors.setdefault((lab.get("tensor"), lab.get("kind")), {
                **base, "tensor": lab.get("tensor", ""), "kind": lab.get("kind", ""),
                "sum3": None, "sum4": None})
            row[name[7:]] = value
        elif name == "moe.expert_tokens":
            lab = dict(labels)
            experts.append({**base, "layer": lab["layer"], "expert": int(lab["expert"]),
                            "tokens": value, "shard": int(lab.get("shard", 0))})
    return {"rank_metrics": ranks, "tensor_stats": [t for t in tensors.values() if "n" in t],
            "expert_stats": experts}


@dataclass(kw_only=True, slots=True)
class Stage2Config:
    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    retention_every_k: int = 100
    retention_halo: int = 100
    warmup_steps: int = 100
    final_steps: int = 100
    max_wait_s: float = 40.0
    run_idle_s: float = 120.0


@dataclass(slots=True)
class Stage2Output:
    """Rows by table (detail goes to the ``*_recent`` tables), steps to promote, controls."""

    rows: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    promote: list[int] = field(default_factory=list)
    controls: list[dict[str, Any]] = field(default_factory=list)

    def extend(self, other: "Stage2Output") -> None:
        for table, rows in other.rows.items():
            self.rows[table].extend(rows)
        self.promote += other.promote
        self.controls += other.controls


def _episode_update(episode: Episode, step: int, f: Finding) -> dict[str, Any]:
    """The page record of ``episode`` (same key: it replaces the stored row) with the
    episode's event count, its latest step and what the latest event measured."""
    record = episode.record or {}
    first = record["message"].split(" | episode:")[0]
    z = "" if f.z is None else f", z={f.z:.1f}"
    who = f", {f.culprit}" if f.culprit and f.culprit != record["culprit"] else ""
    return {**record, "ranks": sorted(set(record["ranks"]) | set(f.ranks)),
            "message": f"{first} | episode: {episode.count} events, the latest at step "
                       f"{step} ({f.kind} {f.value:.4g}{z}{who})"}


class RunPipeline:
    """Everything stage 2 knows about one run."""

    def __init__(self, run_id: str, config: Stage2Config) -> None:
        self.run_id = run_id
        self.config = config
        self.orderer = StepOrderer(config.max_wait_s)
        self.detectors = SignalDetectors(config.detectors)
        self.retention: RetentionPolicy = RetentionPolicy(
            k=config.retention_every_k, halo=config.retention_halo,
            warmup_steps=config.warmup_steps, final_steps=config.final_steps)
        self.tokens = 0
        self.flops = 0.0
        self.last_step = -1
        self.skipped: set[int] = set()   # steps a gap skip passed over; may still arrive
        self.world_size = 0
        self.first_step: int | None = None
        self.last_arrival = 0.0
        self.finished = False
        self.last_control = -10**9

    def accept(self, item: ReducedStep, now: float) -> Stage2Output:
        self.last_arrival = now
        self.finished = False
        if item.complete_reason == "late":  # data after its step's deadline: kept as detail
            out = Stage2Output()
            out.rows["rank_metrics_recent"] += _detail_rows(item)["rank_metrics"]
            out.promote.append(item.step)
            return out
        return self._process(self.orderer.offer(item, now))

    def expire(self, now: float) -> Stage2Output:
        out = self._process(self.orderer.expire(now))
        if not self.finished and self.last_step >= 0 and not self.orderer.held \
                and now - self.last_arrival >= self.config.run_idle_s:
            out.extend(self.finish())
        return out

    def finish(self) -> Stage2Output:
        """The run ended: release the final steps and mark the run finished."""
        out = Stage2Output()
        out.promote += [s for s, _ in self.retention.finish()]
        self.finished = True
        out.rows["runs"].append(self._run_row("finished"))
        return out

    def _process(self, items: list[ReducedStep]) -> Stage2Output:
        out = Stage2Output()
        for item in items:
            if item.step <= self.last_step and item.step not in self.skipped:
                continue  # re-delivery: already counted
            after_gap = item.step < self.last_step
            self.skipped.discard(item.step)
            self.skipped.update(range(self.last_step + 1, item.step))
            out.extend(self._step(item, after_gap))
        if items:
            out.rows["runs"].append(self._run_row("running"))
        return out

    def _step(self, item: ReducedStep, after_gap: bool) -> Stage2Output:
        out = Stage2Output()
        view, sources = p0_view(item)
        self.world_size = max(self.world_size, item.world_size)
        self.first_step = item.step if self.first_step is None else self.first_step
        self.tokens += view["step_tokens"]
        self.flops += view.pop("flops_step") or 0.0
        self.last_step = max(self.last_step, item.step)
        derived, findings = self.detectors.observe(
            item.step, view, {s: loss for s, (loss, _, _) in sources.items()},
            _rank_series(item, view["loss_worst_rank_id"]))
        view.pop("moe_maxvio_layer")
        view["clipped"] = derived.pop("clipped")
        row = {"run_id": self.run_id, "step": item.step, "tokens": self.tokens,
               "flops": self.flops, **view, **derived}
        if after_gap:
            row["complete_reason"] = "after_gap"
        out.rows["step_metrics"].append(row)
        out.rows["source_metrics"] += [
            {"run_id": self.run_id, "step": item.step, "source": s, "loss": loss,
             "token_share": share, "tokens": int(n)} for s, (loss, share, n) in sources.items()]
        for table, rows in _detail_rows(item).items():
            out.rows[f"{table}_recent"] += rows
        for finding in findings:  # every finding is recorded; the gate only dedups pages
            out.rows["anomalies"].append(self._anomaly_row(item.step, finding))
            alert = self._page(item.step, finding) if finding.page else None
            if alert is not None:
                out.rows["alerts"].append(alert)
        out.promote += [s for s, _ in self.retention.offer(item.step, None, bool(findings))]
        if findings and item.step - self.last_control > self.config.retention_halo:
            self.last_control = item.step
            reason = ", ".join(sorted({f.signal for f in findings}))
            out.controls += [
                {"run_id": self.run_id, "action": "densify", "steps": self.config.retention_halo,
                 "step": item.step, "reason": reason},
                {"run_id": self.run_id, "action": "dump", "step": item.step, "reason": reason}]
        return out

    def _anomaly_row(self, step: int, f: Finding) -> dict[str, Any]:
        return {"run_id": self.run_id, "step": step, "signal": f.signal, "kind": f.kind,
                "value": f.value, "baseline": f.baseline, "z": f.z, "culprit": f.culprit}

    def _page(self, step: int, f: Finding) -> dict[str, Any] | None:
        """The page record to send: a new page, the updated record of the page whose
        episode this finding is a new event of, or None (the same event continues)."""
        episode = self.detectors.pages.admit(step, f)
        if not episode.new_event:
            return None
        if episode.count == 1 or episode.record is None:
            episode.record = self._alert_row(step, f)
        else:
            episode.record = _episode_update(episode, step, f)
        return episode.record

    def _alert_row(self, step: int, f: Finding) -> dict[str, Any]:
        baseline = "n/a" if f.baseline is None else f"{f.baseline:.4g}"
        z = "" if f.z is None else f", z={f.z:.1f}"
        culprit = f"; carried by {f.culprit}" if f.culprit else ""
        return {"run_id": self.run_id, "step": step, "signal": f.signal, "severity": "page",
                "culprit": f.culprit,
                "value": f.value, "baseline": f.baseline, "z": f.z, "tokens": self.tokens,
                "ranks": list(f.ranks),
                "message": f"{f.signal} {f.kind} at step {step}: {f.value:.4g} against "
                           f"baseline {baseline}{z}{culprit}",
                "next_steps": next_steps(f.category)}

    def _run_row(self, status: str) -> dict[str, Any]:
        return {"run_id": self.run_id, "world_size": self.world_size,
                "first_step": self.first_step or 0, "last_step": max(self.last_step, 0),
                "status": status}

    # -- persistence ------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "flops": self.flops, "last_step": self.last_step,
                "skipped": sorted(self.skipped), "world_size": self.world_size,
                "first_step": self.first_step, "finished": self.finished,
                "last_control": self.last_control,
                "detectors": self.detectors.to_state(), "retention": self.retention.to_state(),
                "orderer": self.orderer.to_state()}

    @classmethod
    def from_state(cls, run_id: str, config: Stage2Config, state: dict[str, Any],
                   now: float) -> "RunPipeline":
        run = cls(run_id, config)
        run.tokens, run.flops, run.last_step = state["tokens"], state["flops"], state["last_step"]
        run.skipped = set(state["skipped"])
        run.world_size, run.first_step = state["world_size"], state["first_step"]
        run.finished, run.last_control = state["finished"], state["last_control"]
        run.detectors = SignalDetectors.from_state(config.detectors, state["detectors"])
        run.retention = RetentionPolicy.from_state(state["retention"])
        run.orderer = StepOrderer.from_state(state["orderer"], config.max_wait_s, now)
        run.last_arrival = now
        return run
