"""Semantic checks of one rank's step, right after decode and before anything is sized by it.

The decoder answers "is this a well-formed rank message"; this module answers "is it a
plausible step of its run", with bounds from settings (``Bounds``):

- step in ``0..max_step`` and at most ``max_step_ahead`` beyond the newest step of its run;
- ``1 <= world_size <= max_world_size``, ``0 <= rank < world_size``, parallel coordinates
  in ``0..world_size-1``; every rank of a run reports the world size its first message did;
- counts (tokens, elements, bytes, steps, FLOPs, ...) and times finite, >= 0 and at most
  what one rank can measure in one step (``count_limit``: 2^40 tokens, 10^30 FLOPs, else
  2^53, the integers a float64 holds exactly); a value past it (``1e20`` tokens, ``2^64``)
  is not a measurement, and summed into a run's cumulative UInt64 token count it would
  make every later step of the run unstorable (a loss sum is not a count: its NaN or ±inf
  is what a diverging rank measures, and is kept); ``-0.0`` is a count of 0;
- a loss sum comes with its token count (same labels), and is 0 where that count is 0;
- label values at most ``max_label_length`` characters without ``|`` (the label-text
  separator); expert and shard indices decimal integers that fit the store's UInt32; a
  user metric's name as ``userlog.name_problem`` allows;
- at most ``max_label_values`` distinct values of one label key per run: points that
  would add more are dropped and reported (the rest of the message is kept).

A message that breaks any rule but the last is refused whole (a dead letter with the
reason). Memory is bounded: ``max_runs`` runs are remembered, least recently seen first out.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from probewire.instrument.catalog import (
    CATALOG,
    Label,
    Loss,
    Modality,
    Moe,
    Output,
    Residual,
    System,
)
from probewire.instrument.plumbing import check
from probewire.instrument.userlog import name_problem
from probewire.instrument.wire import RankStep

__all__ = ["Bounds", "Checked", "StepValidator", "count_limit"]

_COUNTS = frozenset(name for name, spec in CATALOG.items() if spec.nonnegative)
_MAX_COUNT = float(2**53)
# Per rank and step, by catalog name; every other count: _MAX_COUNT. Token counts are
# summed over ranks (and, for step_metrics.tokens, over steps) into UInt64 columns: 2^40
# (10^12) tokens per rank and step is far past any batch, and 2^24 rank-steps of it still
# fit. FLOPs are stored as Float64; 10^30 is past any device-step.
_COUNT_LIMITS = {
    Loss.TOKENS: float(2**40),
    System.POSITIONS: float(2**40),
    Modality.TOKENS: float(2**40),
    Moe.EXPERT_TOKENS: float(2**40),
    Moe.MARGIN_TOKENS: float(2**40),
    Residual.TOKENS: float(2**40),
    Output.POSITIONS: float(2**40),
    System.FLOPS: 1e30,
}


def count_limit(name: str) -> float:
    """The largest value one rank may report for the count ``name`` in one step."""
    return _COUNT_LIMITS.get(name, _MAX_COUNT)


_INDEX_LABELS = frozenset({Label.EXPERT, Label.SHARD})
_UINT32 = 2**32


@dataclass(kw_only=True, slots=True)
class Bounds:
    """Limits on what one rank message may claim (``stream.bounds``)."""

    max_world_size: int = 65_536
    max_step: int = 2**53  # steps are exact in a float64 (the store's Float columns)
    max_step_ahead: int = 1_000_000  # beyond the run's newest step: a corrupt step number
    max_label_values: int = 10_000  # distinct values of one label key in one run
    max_label_length: int = 256
    max_runs: int = 10_000  # runs remembered for the per-run checks

    def __post_init__(self) -> None:
        for name in (
            "max_world_size",
            "max_step",
            "max_step_ahead",
            "max_label_values",
            "max_label_length",
            "max_runs",
        ):
            check(getattr(self, name) >= 1, name, "must be >= 1")


@dataclass(slots=True)
class Checked:
    """The verdict on one message: ``record`` None means refuse it whole; a ``reason`` with
    a record means points were dropped (dead-letter a copy, go on with the record)."""

    record: RankStep | None
    reason: str | None = None


@dataclass(slots=True)
class _Run:
    world_size: int
    newest_step: int
    labels: dict[str, set[str]] = field(default_factory=dict)
    counted: set = field(default_factory=set)  # label sets whose every value is in labels


_CHECKED_MAX = 1 << 16
"""Label sets remembered as passing (per validator, and per run for cardinality): a rank
sends the same label sets every step, so each is checked once; bounded, emptied when full."""


class StepValidator:
    """Per-run checks over the messages of each run this worker sees."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self._runs: OrderedDict[str, _Run] = OrderedDict()
        self._labels_ok: set = set()  # label sets that passed the length and index rules

    def world_size(self, run_id: str) -> int | None:
        """The world size of ``run_id`` as its first accepted message said (None: unseen)."""
        run = self._runs.get(run_id)
        return None if run is None else run.world_size

    def check(self, record: RankStep) -> Checked:
        reason = self._refusal(record)
        if reason is not None:
            return Checked(None, reason)
        run = self._runs.get(record.run_id)
        if run is None:
            run = self._runs[record.run_id] = _Run(record.world_size, record.step)
            while len(self._runs) > self.bounds.max_runs:
                self._runs.popitem(last=False)
        else:
            self._runs.move_to_end(record.run_id)
            if record.world_size != run.world_size:
                return Checked(
                    None,
                    f"world size {record.world_size} of rank {record.rank} "
                    f"disagrees with run {record.run_id!r}'s world size "
                    f"{run.world_size}",
                )
            if record.step > run.newest_step + self.bounds.max_step_ahead:
                return Checked(
                    None,
                    f"step {record.step} is more than max_step_ahead="
                    f"{self.bounds.max_step_ahead} beyond the run's newest "
                    f"step {run.newest_step}",
                )
        dropped = self._over_cardinality(record, run)
        run.newest_step = max(run.newest_step, record.step)
        if not dropped:
            return Checked(record)
        keys = ", ".join(sorted({k for k, _ in dropped}))
        return Checked(
            record,
            f"{len(dropped)} point(s) dropped: label {keys} of run "
            f"{record.run_id!r} over max_label_values="
            f"{self.bounds.max_label_values}",
        )

    def _refusal(self, record: RankStep) -> str | None:
        b = self.bounds
        if not 0 <= record.step <= b.max_step:
            return f"step {record.step} outside 0..{b.max_step}"
        if not 1 <= record.world_size <= b.max_world_size:
            return f"world size {record.world_size} outside 1..{b.max_world_size}"
        if not 0 <= record.rank < record.world_size:
            return f"rank {record.rank} outside world size {record.world_size}"
        for group, coord in record.coords.items():
            if not 0 <= coord < record.world_size:
                return f"coordinate {group}={coord} outside world size {record.world_size}"
        labels_ok = self._labels_ok
        for (name, labels), value in record.values.items():
            if name in _COUNTS and not (math.isfinite(value) and 0 <= value <= count_limit(name)):
                return (
                    f"count {name} must be finite and in 0..{count_limit(name):.6g} "
                    f"(one rank, one step), got {value!r}"
                )
            if labels not in labels_ok:  # a rank sends the same label sets every step
                for key, text in labels:
                    if len(text) > b.max_label_length or "|" in text:
                        return (
                            f"label {key} of {name} must be at most {b.max_label_length} "
                            f"characters without '|', got {text[:40]!r}"
                        )
                    if key in _INDEX_LABELS and not (text.isdecimal() and int(text) < _UINT32):
                        return f"label {key} of {name} must be an index in 0..2^32-1, got {text!r}"
                    if key == Label.NAME and name_problem(text) is not None:
                        return f"label {key} of {name}: {name_problem(text)}"
                if len(labels_ok) >= _CHECKED_MAX:
                    labels_ok.clear()
                labels_ok.add(labels)
            if name == Loss.SUM:
                tokens = record.values.get((Loss.TOKENS, labels))
                if tokens is None or (tokens == 0 and value != 0):
                    return (
                        f"{Loss.SUM} {dict(labels) or ''} needs its {Loss.TOKENS} (> 0 "
                        "where the sum is not 0)"
                    )
        return None

    def _over_cardinality(self, record: RankStep, run: _Run) -> list[tuple[str, str]]:
        """Drop (in place) the points whose labels would pass ``max_label_values``."""
        limit, dropped, counted = self.bounds.max_label_values, [], run.counted
        for series in list(record.values):
            if series[1] in counted:  # every value of this label set is counted already
                continue
            for key, text in series[1]:
                seen = run.labels.setdefault(key, set())
                if text not in seen:
                    if len(seen) >= limit:
                        del record.values[series]
                        dropped.append((key, text))
                        break
                    seen.add(text)
            else:
                if len(counted) >= _CHECKED_MAX:
                    counted.clear()
                counted.add(series[1])
        return dropped
