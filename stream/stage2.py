"""Stage 2: one run's reduced steps, in step order, become the rows people page on.

For each step: the P0 view (seeds 001 §1-§7) from the reduced components, cumulative
tokens and FLOPs, the detectors of ``signals``, anomaly and alert records, and the
retention decision for per-rank and P1/P2 detail. Detail is written for every step to
short-lived ``*_recent`` tables (the durable look-back buffer); steps the retention policy
keeps are promoted from there. The whole state serialises, so a restarted worker resumes
with no gap and no double count.

Nothing a run does makes this module raise or drop a step:

- a run idle for ``run_idle_s`` has its final steps retained, and its status says what
  the silence means: a run that announced itself (a lifecycle event, ``lifecycle``) and
  said neither ``finished`` nor ``crashed`` is ``stalled`` and pages ``job_state``
  (``jobstate``: the last step, the ranks last heard from); a run that never announced
  itself (no lifecycle events: nothing else can end it) is ``finished``. A step after
  that (the run paused for a checkpoint save or an evaluation) reopens it as
  ``running``, and is stored; going silent again releases the new final steps (and pages
  again); ``finish`` is idempotent;
- a step that arrives after the orderer skipped its gap is stored with
  ``complete_reason = "after_gap"``. Its detail is retained, and it is scored and pages
  as it arrives (its page says it is late, ``LATE_NOTE``): the detectors score it against
  their windows as they stand, on a copy, since those windows hold the run's steps in
  order and it is not added to them. It counts in the run's cumulative tokens and FLOPs
  from then on.
  A re-delivered step (at or below the newest, and not skipped) is dropped.
- detail that stage 1 sends on its own topic (``probewire.detail_steps``: the per-rank
  values and tensor statistics of a scan-tier step, a replay of the ranks' ring buffers, a
  rank block's per-rank values) never passes through this ordered path: ``detail_output``
  makes its look-back rows, the worker writes them apart, then promotes them when
  ``detail_kept`` says so (a replay always; other detail when its step was kept before
  they were written; a step kept after that promotes them itself).
- a step's scan-tier values (``complete_reason = "scan"``: its reduced values alone, their
  detail gone to the detail topic) never hold their step back: their columns join the
  step's row before or after it (``scanjoin``).
- the first time a run's detail carries a tensor label, its ``tensor_names`` row (block,
  role, expert: ``dimensions``) is written, once; the names seen are part of the state
  (bounded by ``validate``'s ``max_label_values`` distinct tensor labels per run).
- a step whose components break the rules of ``derive`` (which stage 1's bounds rule
  out; only another writer of the steps topic could send one) is refused before any state
  moves: ``Stage2Output.refused`` names it and the reason, and the worker dead-letters it;
- a step whose ranks sent different clip thresholds (``grad.clip_threshold``) is stored,
  and ``Stage2Output.dead_letters`` says so with the ranks of each threshold, once per
  disagreement;
- a run that said it ended releases its final steps' detail once the step its event named
  is in, and at the latest when the worker stops (``at_shutdown``).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from probewire.instrument.catalog import Grad
from probewire.instrument.plumbing import check

from .dimensions import tensor_dimensions
from .formed import grad_group_rows, residual_rows
from .inputs import StepInputs
from .jobstate import stall_alert
from .lifecycle import RunEvent, RunLifecycle
from .messages import alert_message, describe_value
from .order import SkippedSteps, StepOrderer
from .pages import Episode
from .records import CompleteReason, RankMatrix, ReducedStep
from .retention import RetentionPolicy
from .scanjoin import ScanJoin
from .series import GUARD_TOTAL, StepMetrics
from .signals import DetectorConfig, Finding, SignalDetectors, next_steps
from .usermetrics import user_rows
from .view import (
    P0View,
    RankRows,
    clip_disagreement,
    detail_rows,
    p0_view,
    rank_rows,
    rank_table,
)

__all__ = ["RunPipeline", "Stage2Config", "Stage2Output", "detail_output", "p0_view"]

LATE_NOTE = (
    " | late: this step arrived after stream.stage2.max_wait_s, after later steps; scored "
    "against the detectors' windows as they stood then"
)
"""What a page of a step that came after its gap was skipped adds to its message."""


@dataclass(kw_only=True, slots=True)
class Stage2Config:
    """Per-run processing (``stream.stage2``): detectors, retention, step order, idle end."""

    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    retention_every_k: int = 100  # keep every k-th step at full detail
    retention_halo: int = 100  # steps kept on either side of an anomaly
    warmup_steps: int = 100  # first steps kept
    final_steps: int = 100  # last steps kept
    max_wait_s: float = 40.0  # a gap is skipped after this (> stream.deadline_s)
    run_idle_s: float = 600.0  # no step for this long: stalled (or finished); > a checkpoint save

    def __post_init__(self) -> None:
        d = self.detectors
        check(d.window >= 3, "detectors.window", "must be >= 3")
        for name in (
            "loss_z",
            "grad_z",
            "signal_z",
            "min_spread",
            "clip_threshold",
            "memory_growth",
            "maxvio_threshold",
            "media_scale_min",
            "residual_ratio_min",
            "residual_ratio_max",
            "early_z_factor",
            "grad_audit_tolerance",
            "clip_rate_rise",
            "shard_imbalance_max",
            "h_norm_drop",
            "pi_shift",
            "media_scale_max",
            "vanish_ratio",
            "headroom_min",
            "straggler_job_slowdown",
            "straggler_cusum_k",
            "straggler_cusum_h",
            "straggler_cusum_scale",
            "loss_shift_k",
            "loss_shift_h",
            "loss_shift_scale",
            "heldout_bpb_rise",
        ):
            check(getattr(d, name) > 0, f"detectors.{name}", "must be > 0")
        check(d.early_history >= 3, "detectors.early_history", "must be >= 3")
        check(d.shift_history >= 3, "detectors.shift_history", "must be >= 3")
        check(d.loss_shift_delay >= 0, "detectors.loss_shift_delay", "must be >= 0")
        for cap, k in (
            ("straggler_cusum_cap", "straggler_cusum_k"),
            ("loss_shift_cap", "loss_shift_k"),
        ):
            check(getattr(d, cap) > getattr(d, k), f"detectors.{cap}", f"must exceed {k}")
        check(
            d.straggler_ratio > 1,
            "detectors.straggler_ratio",
            "must be > 1 (S, a rank's own time over the others' median, is >= 1)",
        )
        for tier in ("held", "recent"):
            check(
                getattr(d, f"straggler_{tier}_ratio") > 1,
                f"detectors.straggler_{tier}_ratio",
                "must be > 1",
            )
            check(
                0 < getattr(d, f"straggler_{tier}_quantile") < 1,
                f"detectors.straggler_{tier}_quantile",
                "must lie in (0, 1)",
            )
        for name in (
            "clip_window",
            "rearm_steps",
            "maxvio_steps",
            "straggler_steps",
            "straggler_held_steps",
            "straggler_recent_steps",
            "heldout_window",
            "heldout_min_history",
        ):
            check(getattr(d, name) >= 1, f"detectors.{name}", "must be >= 1")
        check(self.retention_every_k >= 1, "retention_every_k", "must be >= 1")
        for name in ("retention_halo", "warmup_steps", "final_steps"):
            check(getattr(self, name) >= 0, name, "must be >= 0")
        for name in ("max_wait_s", "run_idle_s"):
            check(getattr(self, name) > 0, name, "must be > 0")


@dataclass(slots=True)
class Stage2Output:
    """Rows by table (detail goes to the ``*_recent`` tables), column batches by table (the
    per-rank detail, up to millions of values a step: the wire's arrays, made into one Arrow
    table a table at the write, no Python object per value), steps to promote,
    controls, the steps refused with their reason, and the stored steps with something the
    ranks disagree on (both dead-lettered with the reason)."""

    rows: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    columns: dict[str, list[RankRows]] = field(default_factory=dict)
    promote: list[int] = field(default_factory=list)
    controls: list[dict[str, Any]] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    dead_letters: list[tuple[int, str]] = field(default_factory=list)
    rewrites: int = 0  # step_metrics rows that are a newer version of a stored step's row

    def add_columns(self, table: str, parts: list[RankRows]) -> None:
        """Append per-rank values bound for ``table``."""
        self.columns.setdefault(table, []).extend(parts)

    def retain_detail(self) -> None:
        """The look-back rows also into their detail tables (detail of a step already kept):
        one insert each, where ``promote`` would copy the step's whole look-back again for
        every detail part of it (a 2,048-rank scan step comes in dozens of parts)."""
        for table in [t for t in self.rows if t.endswith("_recent")]:
            self.rows[table.removesuffix("_recent")] += self.rows[table]
        for table in [t for t in self.columns if t.endswith("_recent")]:
            self.add_columns(table.removesuffix("_recent"), self.columns[table])

    def extend(self, other: Stage2Output) -> None:
        for table, rows in other.rows.items():
            self.rows[table].extend(rows)
        for table, columns in other.columns.items():
            self.add_columns(table, columns)
        self.promote += other.promote
        self.controls += other.controls
        self.refused += other.refused
        self.dead_letters += other.dead_letters
        self.rewrites += other.rewrites


def column_rows(parts: list[RankRows]) -> list[dict[str, Any]]:
    """A column batch as row dicts (to find, row by row, what the store refuses)."""
    return rank_table(parts).to_pylist()


_DETAIL_ONLY = frozenset({CompleteReason.DETAIL, CompleteReason.REPLAY})
"""What only the detail topic carries: a stage 1 that sent it on the steps topic is refused."""


def detail_output(item: ReducedStep, matrix: RankMatrix) -> Stage2Output:
    """The look-back rows of detail from the detail topic (``ReducedStep.detail_from_bytes``):
    per-rank values as a column batch, the tensor and expert statistics as rows. No run
    state: the worker names the tensors with ``RunPipeline.name_tensors`` and decides
    promotion after the write."""
    out = Stage2Output()
    _add_detail(out, item, matrix)
    return out


def _add_detail(out: Stage2Output, item: ReducedStep, matrix: RankMatrix) -> None:
    """A step's detail into the look-back tables: per-rank values as a column batch, the
    tensor and expert statistics as rows."""
    out.add_columns("rank_metrics_recent", [rank_rows(item, matrix)])
    for table, rows in detail_rows(item).items():
        out.rows[f"{table}_recent"] += rows


def _episode_update(episode: Episode, step: int, f: Finding) -> dict[str, Any]:
    """The page record of ``episode`` (same key: it replaces the stored row) with the
    episode's event count, its latest step and what the latest event measured."""
    record = episode.record or {}
    first = record["message"].split(" | episode:")[0]
    z = "" if f.z is None else f", z={f.z:.1f}"
    who = f", {f.culprit}" if f.culprit and f.culprit != record["culprit"] else ""
    return {
        **record,
        "ranks": sorted(set(record["ranks"]) | set(f.ranks)),
        "message": f"{first} | episode: {episode.count} events, the latest at step "
        f"{step} ({f.kind} {describe_value(f.signal, f.kind, f.value)}{z}{who})",
    }


class RunPipeline:
    """Everything stage 2 knows about one run."""

    def __init__(self, run_id: str, config: Stage2Config) -> None:
        self.run_id = run_id
        self.config = config
        self.orderer = StepOrderer(config.max_wait_s)
        self.detectors = SignalDetectors(config.detectors)
        self.retention: RetentionPolicy = RetentionPolicy(
            k=config.retention_every_k,
            halo=config.retention_halo,
            warmup_steps=config.warmup_steps,
            final_steps=config.final_steps,
        )
        self.tokens = 0
        self.flops = 0.0
        self.guard = dict.fromkeys(
            (t.name for t in GUARD_TOTAL.values()), 0
        )  # cumulative guard counters
        self.last_step = -1
        self.skipped = SkippedSteps()  # steps a gap skip passed over; may still arrive
        self.world_size = 0
        self.first_step: int | None = None
        self.last_arrival = 0.0
        self.finished = False
        self.last_control = -(10**9)
        self.lifecycle = RunLifecycle()  # what the run said: config, finished, crashed
        self.tensors: set[str] = set()  # tensor labels with a tensor_names row
        self.said_last_step = -1  # the newest last step a lifecycle event named
        self.heard_step = -1  # the newest step any rank sent, and the ranks that sent it
        self.heard_ranks: set[int] = set()
        self.clip_disagreement: dict[float, list[int]] | None = None  # said once, until healed
        self.scans = ScanJoin()  # scan-tier steps and the rows they join (not saved)

    def accept(self, item: ReducedStep, now: float) -> Stage2Output:
        """One reduced step from stage 1 (any order, any number of times)."""
        out = self.name_tensors(self._accept(item, now))
        self.scans.kept(out.promote)
        sm = StepMetrics
        for row in out.rows.get("step_metrics", ()):  # stored steps: who was heard last
            if row[sm.step] >= self.heard_step:
                self.heard_step = row[sm.step]
                self.heard_ranks = set(range(self.world_size)) - set(row[sm.ranks_missing])
        return out

    @property
    def stalled(self) -> bool:
        """Silent past ``run_idle_s`` without having said it finished or crashed."""
        return self.finished and self.lifecycle.announced and self.lifecycle.ended is None

    def status(self) -> str:
        """What the ``runs`` row says now (``RunLifecycle.status``)."""
        return self.lifecycle.status(self.finished and not self.stalled, self.stalled)

    def name_tensors(self, out: Stage2Output) -> Stage2Output:
        """A ``tensor_names`` row for each tensor label the run's detail carries first here."""
        if named := self.tensor_names(out):
            self.tensors.update(row["tensor"] for row in named)
            out.rows["tensor_names"] += named
        return out

    def tensor_names(self, out: Stage2Output) -> list[dict[str, Any]]:
        """The ``tensor_names`` rows of the tensor labels ``out`` carries first (the names are
        not marked as written: ``name_tensors`` does, or the caller once they are)."""
        named: dict[str, dict[str, Any]] = {}
        for row in out.rows.get("tensor_stats_recent", ()):
            name = row["tensor"]
            if name and name not in self.tensors and name not in named:
                layer, role, expert = tensor_dimensions(name)
                named[name] = {
                    "run_id": self.run_id,
                    "tensor": name,
                    "layer": layer,
                    "role": role,
                    "expert": expert,
                    "first_step": row["step"],
                }
        return list(named.values())

    def _accept(self, item: ReducedStep, now: float) -> Stage2Output:
        self.last_arrival = now
        self.finished = False  # a step after an idle expiry reopens the run
        if item.complete_reason == CompleteReason.SCAN:
            return self._accept_scan(item)
        if (
            item.complete_reason == CompleteReason.LATE
        ):  # data after its step's deadline: kept as detail
            out = Stage2Output()
            out.add_columns("rank_metrics_recent", [rank_rows(item, RankMatrix.of(item.per_rank))])
            out.promote.append(item.step)
            return out
        if item.complete_reason in _DETAIL_ONLY:
            out = Stage2Output()
            out.refused.append((item.step, f"{item.complete_reason} detail on the steps topic"))
            return out
        return self._process(self.orderer.offer(item, now))

    def detail_kept(self, item: ReducedStep) -> bool:
        """Whether detail just written (``detail_output``) is promoted: a replay always; other
        detail when its step was kept already (a step kept later promotes it itself)."""
        return item.complete_reason == CompleteReason.REPLAY or self.scans.is_kept(item.step)

    def _accept_scan(self, item: ReducedStep) -> Stage2Output:
        """A step's scan-tier values joined to its step's row (``scanjoin``); their detail
        is stored apart (``detail_output``)."""
        out = Stage2Output()
        if self.scans.has_row(item.step):
            row, joined = self.scans.join(item)
            if row is not None:
                out.rows["step_metrics"].append(row)
                out.rewrites += 1
                out.rows["residual_stats"] += residual_rows(joined.inputs)
                view = dict.fromkeys(row) | joined.columns
                for finding in self.detectors.observe_scan(view, joined.ranks):
                    out.rows["anomalies"].append(self._anomaly_row(item.step, finding))
                    alert = self._page(item.step, finding) if finding.page else None
                    if alert is not None:
                        out.rows["alerts"].append(alert)
                    out.promote.append(item.step)
        elif item.step > self.last_step or item.step in self.skipped:
            self.scans.hold(item)  # its step is still to come
        return out

    def expire(self, now: float) -> Stage2Output:
        out = self.name_tensors(self._process(self.orderer.expire(now)))
        if (
            not self.finished
            and self.last_step >= 0
            and not self.orderer.held
            and now - self.last_arrival >= self.config.run_idle_s
        ):
            out.extend(self.finish(now - self.last_arrival))
        self.scans.kept(out.promote)
        return out

    def finish(self, silent_s: float = 0.0) -> Stage2Output:
        """The run went silent: release the final steps and write its status, ``stalled``
        with a ``job_state`` page when it had not ended (once: a finished run with no step
        since gives an empty output)."""
        out = Stage2Output()
        if self.finished:
            return out
        out.promote += [s for s, _ in self.retention.finish()]
        self.finished = True
        if self.stalled:
            ranks = self.heard_ranks if self.heard_step == self.last_step else ()
            out.rows["alerts"].append(
                stall_alert(self.run_id, max(self.last_step, 0), ranks, silent_s, self.tokens)
            )
        out.rows["runs"].append(self._run_row())
        return out

    def on_event(self, event: RunEvent) -> Stage2Output:
        """A lifecycle event of the run (``stream.lifecycle``): its ``runs`` row, when the
        event changed the run's status or configuration."""
        out = Stage2Output()
        # a note on a run this worker never heard of (one written outside the stream, a
        # simulated run): kept, but no runs row, which would blank the one stored
        unknown = self.world_size == 0 and self.last_step < 0 and not self.lifecycle.announced
        if self.lifecycle.apply(event) and not (event.event == "note" and unknown):
            out.rows["runs"].append(self._run_row())
        self.said_last_step = max(self.said_last_step, event.step)
        out.extend(self._release_final())
        self.scans.kept(out.promote)
        return out

    def _release_final(self) -> Stage2Output:
        """A run that said it ended (finished or crashed) keeps the detail of its final steps
        at once, not after ``run_idle_s`` of silence: when no step is held back and the last
        step its event named has been processed (an event can arrive before the steps it
        follows; one that names no step leaves the release to the silence). A step after that (a late one, a resumed
        run) is released the same way; ``retention.finish`` releases each step once."""
        out = Stage2Output()
        if (
            self.lifecycle.ended is not None
            and self.said_last_step >= 0  # an event that names no step waits for the silence
            and self.last_step >= self.said_last_step
            and not self.orderer.held
        ):
            out.promote += [s for s, _ in self.retention.finish()]
        return out

    def at_shutdown(self) -> Stage2Output:
        """The worker stops: a run that said it ended keeps its final steps' detail now,
        even where the step its event named is not in yet or no step was named (the
        release would otherwise wait for a worker that may not come back); a step that
        comes after a restart is kept as it comes. A run that never said it ended is left
        to ``run_idle_s`` of silence."""
        out = Stage2Output()
        if self.lifecycle.ended is not None:
            out.promote += [s for s, _ in self.retention.finish()]
        return out

    def _process(self, items: list[ReducedStep]) -> Stage2Output:
        out = Stage2Output()
        for item in items:
            if item.step <= self.last_step and item.step not in self.skipped:
                continue  # re-delivery: already counted
            item = self.scans.early(item)
            try:
                inputs = StepInputs(item)
                view = p0_view(item, inputs)
            except ValueError as exc:  # malformed components: refused, no state moved
                out.refused.append(
                    (
                        item.step,
                        f"step {item.step} of run {self.run_id!r} refused by stage 2: {exc}",
                    )
                )
                continue
            out.dead_letters += self._clip_letter(item)
            after_gap = item.step < self.last_step
            self.skipped.discard(item.step)
            self.skipped.add(self.last_step + 1, item.step - 1)
            out.extend(self._step(item, view, inputs, after_gap))
        if items:
            out.rows["runs"].append(self._run_row())
            out.extend(self._release_final())
        return out

    def on_evaluations(self, rows: list[dict[str, Any]]) -> Stage2Output:
        """The run's ``evaluations`` rows (the evaluator's records, stored by the worker):
        each reference held-out BPB against its suite's recent evaluations
        (``heldout.HeldoutRise``), in step order; a rise is an anomaly row, and a page when
        the suite's evaluation before it had not risen."""
        out = Stage2Output()
        for row in sorted(rows, key=lambda r: int(r["step"])):
            finding = self.detectors.heldout.observe(row)
            if finding is not None:
                out.rows["anomalies"].append(self._anomaly_row(int(row["step"]), finding))
                alert = self._page(int(row["step"]), finding) if finding.page else None
                if alert is not None:
                    out.rows["alerts"].append(alert)
        return out

    def _clip_letter(self, item: ReducedStep) -> list[tuple[int, str]]:
        """A dead letter when the step's ranks sent different clip thresholds (the step is
        stored; its ``clipped`` is 1 where any rank clipped), once per disagreement: said
        again when the ranks' thresholds change, not on every step it lasts (nor saved: a
        restarted worker says it once more)."""
        ranks = clip_disagreement(item)
        if ranks is None or ranks == self.clip_disagreement:
            self.clip_disagreement = ranks
            return []
        self.clip_disagreement = ranks
        each = "; ".join(f"c={c:g} on ranks {r}" for c, r in sorted(ranks.items()))
        return [
            (
                item.step,
                f"step {item.step} of run {self.run_id!r}: {Grad.CLIP_THRESHOLD} differs "
                f"between ranks ({each}); clipped and clip_rate count a step any rank "
                "clipped: clip every rank at one max_norm",
            )
        ]

    def _step(
        self, item: ReducedStep, p0: P0View, inputs: StepInputs, after_gap: bool
    ) -> Stage2Output:
        out = Stage2Output()
        view, sources = p0.view, p0.sources
        self.world_size = max(self.world_size, item.world_size)
        self.first_step = item.step if self.first_step is None else self.first_step
        sm = StepMetrics
        self.tokens += view[sm.step_tokens]
        self.flops += view.pop("flops_step") or 0.0
        for flag, total in GUARD_TOTAL.items():
            self.guard[total] += view[flag]
        self.last_step = max(self.last_step, item.step)
        # the detectors' windows hold the run's steps in order: a step after its gap is
        # scored against them as they stand, on a copy, and is not added to them
        detectors = (
            SignalDetectors.from_state(self.config.detectors, self.detectors.to_state())
            if after_gap
            else self.detectors
        )
        derived, findings = detectors.observe(
            item.step, view, {s: loss for s, (loss, _, _) in sources.items()}, p0.ranks
        )
        view[sm.clipped] = derived.pop(sm.clipped)
        view.pop("moe_maxvio_layer")
        row = {
            sm.run_id.name: self.run_id,
            sm.step.name: item.step,
            sm.tokens.name: self.tokens,
            sm.flops.name: self.flops,
            **view,
            **self.guard,
            **derived,
        }
        if after_gap:
            row[sm.complete_reason] = CompleteReason.AFTER_GAP.value
        out.rows["step_metrics"].append(row)
        self.scans.stored(item, row)
        out.rows["grad_group_stats"] += grad_group_rows(item)
        out.rows["residual_stats"] += residual_rows(inputs)
        out.rows["user_metrics"] += user_rows(self.run_id, item.step, item.reduced)
        out.rows["source_metrics"] += [
            {
                "run_id": self.run_id,
                "step": item.step,
                "source": s,
                "loss": loss,
                "token_share": share,
                "tokens": int(n),
            }
            for s, (loss, share, n) in sources.items()
        ]
        _add_detail(out, item, RankMatrix.of(item.per_rank))
        for finding in findings:  # every finding is recorded; the gate only dedups pages
            out.rows["anomalies"].append(self._anomaly_row(item.step, finding))
            alert = self._page(item.step, finding, after_gap) if finding.page else None
            if alert is not None:
                out.rows["alerts"].append(alert)
        offer = (
            self.retention.offer_late
            if after_gap
            else lambda step, payload: self.retention.offer(step, payload, bool(findings))
        )
        out.promote += [s for s, _ in offer(item.step, None)]
        if findings and item.step - self.last_control > self.config.retention_halo:
            self.last_control = item.step
            reason = ", ".join(sorted({f.signal for f in findings}))
            out.controls += [
                {
                    "run_id": self.run_id,
                    "action": "densify",
                    "steps": self.config.retention_halo,
                    "step": item.step,
                    "reason": reason,
                },
                {"run_id": self.run_id, "action": "dump", "step": item.step, "reason": reason},
            ]
        return out

    def _anomaly_row(self, step: int, f: Finding) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "step": step,
            "signal": f.signal,
            "kind": f.kind,
            "value": f.value,
            "baseline": f.baseline,
            "z": f.z,
            "culprit": f.culprit,
        }

    def _page(self, step: int, f: Finding, late: bool = False) -> dict[str, Any] | None:
        """The page record to send: a new page, the updated record of the page whose
        episode this finding is a new event of, or None (the same event continues). A
        ``late`` step's page (it came after its gap was skipped) says so."""
        episode = self.detectors.pages.admit(step, f)
        if not episode.new_event:
            return None
        if episode.count == 1 or episode.record is None:
            episode.record = self._alert_row(step, f)
        else:
            episode.record = _episode_update(episode, step, f)
        if late:
            return {**episode.record, "message": episode.record["message"] + LATE_NOTE}
        return episode.record

    def _alert_row(self, step: int, f: Finding) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "step": step,
            "signal": f.signal,
            "severity": "page",
            "culprit": f.culprit,
            "value": f.value,
            "baseline": f.baseline,
            "z": f.z,
            "tokens": self.tokens,
            "ranks": list(f.ranks),
            "message": alert_message(f.signal, f.kind, step, f.value, f.baseline, f.z, f.culprit),
            "next_steps": next_steps(f.category),
        }

    def _run_row(self) -> dict[str, Any]:
        """The run's ``runs`` row; its status is ``status()``."""
        return {
            "run_id": self.run_id,
            "world_size": self.world_size,
            "first_step": self.first_step or 0,
            "last_step": max(self.last_step, 0),
            "status": self.status(),
            "config": self.lifecycle.config_json(),
            "note": self.lifecycle.note,
            "tags": list(self.lifecycle.tags),
        }

    # -- persistence ------------------------------------------------------------------------
    def to_state(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "flops": self.flops,
            "guard": self.guard,
            "last_step": self.last_step,
            "skipped": self.skipped.to_state(),
            "world_size": self.world_size,
            "first_step": self.first_step,
            "finished": self.finished,
            "last_control": self.last_control,
            "lifecycle": self.lifecycle.to_state(),
            "detectors": self.detectors.to_state(),
            "retention": self.retention.to_state(),
            "orderer": self.orderer.to_state(),
            "tensors": sorted(self.tensors),
            "heard": [self.heard_step, sorted(self.heard_ranks)],
            "said_last_step": self.said_last_step,
        }

    @classmethod
    def from_state(
        cls, run_id: str, config: Stage2Config, state: dict[str, Any], now: float
    ) -> RunPipeline:
        run = cls(run_id, config)
        run.tokens, run.flops, run.last_step = state["tokens"], state["flops"], state["last_step"]
        run.guard.update(state.get("guard", {}))  # absent: a state saved before the counters
        run.skipped = SkippedSteps(
            [(s, s) if isinstance(s, int) else tuple(s) for s in state["skipped"]]
        )  # ints: before version 2
        run.world_size, run.first_step = state["world_size"], state["first_step"]
        run.finished, run.last_control = state["finished"], state["last_control"]
        run.lifecycle = RunLifecycle.from_state(state.get("lifecycle"))  # absent before v3
        run.detectors = SignalDetectors.from_state(config.detectors, state["detectors"])
        run.retention = RetentionPolicy.from_state(state["retention"])
        run.orderer = StepOrderer.from_state(state["orderer"], config.max_wait_s, now)
        run.tensors = set(state.get("tensors", ()))  # absent: a state saved before the names
        run.said_last_step = int(state.get("said_last_step", -1))  # absent: saved before it
        heard_step, heard_ranks = state.get("heard", (-1, ()))  # absent: saved before stalls
        run.heard_step, run.heard_ranks = int(heard_step), set(heard_ranks)
        run.last_arrival = now
        return run
