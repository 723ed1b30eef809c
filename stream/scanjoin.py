"""A step's scan-tier detail joined to its step's row, whichever of the two comes first.

The ranks send a step's scan-tier points apart from its step tier (``instrument.export``):
stage 2 forms, stores and pages the step from its step tier alone, as soon as that is
complete, and the detail (``CompleteReason.SCAN``) is reduced and stored on its own. Some
``step_metrics`` columns are formed from scan-tier values (the update ratio ρ, the residual
branches, the media scale γ, ...). They are filled in whichever order the two arrive:

- detail first (its step still to come): it is held (``hold``), and its reduced values
  join the step's own when the step is processed (``early``): the row is the one a single
  message would have made;
- detail after its step: the step's reduced values and row are kept for the newest
  ``keep_rows`` steps (``stored``); the detail fills the columns its values change, and the
  row is written again, whole (``step_metrics`` is a ReplacingMergeTree: the newer version
  is the row); the rules on those columns score them then
  (``SignalDetectors.observe_scan``), and a finding keeps the step's detail;
- detail of a step older than that (or from before a restart: nothing here is saved) is
  stored in the detail tables, and its columns stay empty.

Retention covers the detail whatever its arrival: a step already kept (``kept``) promotes
detail that comes after its decision; a step still in the look-back buffer promotes it when
it is released. Memory: ``keep_rows`` rows and reduced step-tier values, ``hold_scans``
reduced scan steps and ``remember_kept`` step numbers per run.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from .findings import RankSeries
from .inputs import StepInputs
from .records import ReducedStep
from .view import p0_view

__all__ = ["Joined", "ScanJoin", "scan_columns"]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


class Joined(NamedTuple):
    """What a scan step adds to its step: the columns its values change, the inputs they
    were formed from, and its residual branches (the culprits of the scan-tier rules)."""

    columns: dict[str, Any]
    inputs: StepInputs
    ranks: RankSeries


def scan_columns(step: ReducedStep, scan: ReducedStep) -> Joined:
    """The view's columns that ``scan``'s reduced values change, formed from the step's
    reduced values with the scan's beside them."""
    alone = dataclasses.replace(step, per_rank={}, hosts={}, coords={})
    joined = dataclasses.replace(alone, reduced={**step.reduced, **scan.reduced})
    before = p0_view(alone, StepInputs(alone)).view
    inputs = StepInputs(joined)
    after = p0_view(joined, inputs)
    columns = {k: v for k, v in after.view.items() if not _same(v, before.get(k))}
    return Joined(columns, inputs, RankSeries(branch_ratio=after.ranks.branch_ratio))


class ScanJoin:
    """One run's recent step rows, early scan-tier steps and kept steps (see the module)."""

    def __init__(self, keep_rows: int = 256, hold_scans: int = 64, remember_kept: int = 4096):
        self._rows: OrderedDict[int, tuple[ReducedStep, dict[str, Any]]] = OrderedDict()
        self._early: OrderedDict[int, ReducedStep] = OrderedDict()
        self._kept: deque[int] = deque(maxlen=remember_kept)
        self._kept_set: set[int] = set()
        self._limits = (keep_rows, hold_scans)

    def kept(self, steps: Iterable[int]) -> None:
        """Steps whose detail was promoted (the retention decision kept them)."""
        for step in steps:
            if step in self._kept_set:
                continue
            if len(self._kept) == self._kept.maxlen:
                self._kept_set.discard(self._kept[0])
            self._kept.append(step)
            self._kept_set.add(step)

    def is_kept(self, step: int) -> bool:
        return step in self._kept_set

    def hold(self, scan: ReducedStep) -> None:
        """A scan-tier step that came before its step (the oldest held is let go first)."""
        self._early[scan.step] = scan
        while len(self._early) > self._limits[1]:
            self._early.popitem(last=False)

    def early(self, step: ReducedStep) -> ReducedStep:
        """The step with the reduced values of its scan-tier step held here, if any."""
        scan = self._early.pop(step.step, None)
        if scan is None:
            return step
        return dataclasses.replace(step, reduced={**step.reduced, **scan.reduced})

    def stored(self, step: ReducedStep, row: dict[str, Any]) -> None:
        """The step's row as written (its per-rank values are not kept)."""
        self._rows[step.step] = (dataclasses.replace(step, per_rank={}), row)
        self._rows.move_to_end(step.step)
        while len(self._rows) > self._limits[0]:
            self._rows.popitem(last=False)

    def has_row(self, step: int) -> bool:
        return step in self._rows

    def join(self, scan: ReducedStep) -> tuple[dict[str, Any] | None, Joined]:
        """The step's row again with the columns ``scan`` fills (None when it fills none),
        and what the scan adds; the kept row is updated."""
        step, row = self._rows[scan.step]
        found = scan_columns(step, scan)
        columns = {k: v for k, v in found.columns.items() if k in row}
        if not columns:
            return None, found
        joined = {**row, **columns}
        self._rows[scan.step] = (
            dataclasses.replace(step, reduced={**step.reduced, **scan.reduced}),
            joined,
        )
        return joined, found._replace(columns=columns)
