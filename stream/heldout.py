"""The held-out BPB rise rule (issue 38): the evaluator's bits per byte (seeds 001 §10,
metric ``bpb``) of each suite on the run's reference weights stream, against that suite's
own recent evaluations.

An evaluation set is fixed, so consecutive checkpoints' BPB differ only by what training
changed: it falls, then flattens. The baseline is the median of the suite's last
``heldout_window`` evaluations before this one (one bad evaluation does not move it, and a
falling series puts it above the latest value: only a rise past the recent level pages);
``heldout_bpb`` pages when the value stands ``heldout_bpb_rise`` (relative) above it, from
``heldout_min_history`` evaluations on. The evaluations after it that stay risen are the
same episode: anomalies that do not page again (checkpoints are further apart than the
page gate's ``rearm_steps``). Evaluations arrive in the order the evaluator
finishes them: one at or before a step the suite already has is a re-delivery and is
skipped. Pure and serialisable, like ``detect``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .findings import Category, DetectorConfig, Finding
from .rolling import sorted_median

__all__ = ["BPB_METRIC", "HeldoutRise", "SIGNAL"]

BPB_METRIC = "bpb"
"""The evaluator's held-out bits-per-byte metric (``evaluators.suites``, suite heldout)."""
SIGNAL = "heldout_bpb"


class HeldoutRise:
    """Each suite's last evaluations of one run (reference weights stream only)."""

    def __init__(self, config: DetectorConfig, state: Mapping[str, Any] | None = None) -> None:
        self.config = config
        # suite -> (last step, its last ``heldout_window`` values, oldest first, risen)
        self.suites: dict[str, tuple[int, list[float], bool]] = {
            k: (int(step), [float(v) for v in values], bool(risen))
            for k, (step, values, risen) in (state or {}).items()
        }

    def observe(self, row: Mapping[str, Any]) -> Finding | None:
        """One ``evaluations`` row: a finding when it is a reference BPB that rose past its
        suite's baseline (a non-finite BPB pages too: the evaluation diverged)."""
        if row.get("metric") != BPB_METRIC or int(row.get("reference", 1)) != 1:
            return None
        suite, step, value = str(row["suite"]), int(row["step"]), float(row["value"])
        last, values, risen = self.suites.get(suite, (-1, [], False))
        if step <= last:
            return None
        cfg = self.config
        base = sorted_median(sorted(values)) if len(values) >= cfg.heldout_min_history else None
        if math.isfinite(value):
            values = [*values, value][-cfg.heldout_window :]
        rise = base is not None and not value < base * (1 + cfg.heldout_bpb_rise)
        self.suites[suite] = (step, values, rise)
        if not rise:
            return None
        return Finding(
            signal=SIGNAL,
            kind="rise" if math.isfinite(value) else "nonfinite",
            value=value,
            baseline=base,
            z=None,
            category=Category.LOSS,
            page=not risen,
            culprit=f"suite {suite}",
        )

    def to_state(self) -> dict[str, Any]:
        return {k: [step, list(v), risen] for k, (step, v, risen) in self.suites.items()}
