"""What ``probewire explain`` returns: findings per signal, the pages at the step, and the
ranking a person reads first (a leaf module: load, score and render all import it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["STAGES", "Explanation", "Finding", "Page", "StepNotFound"]

STAGES = ("job state", "loss", "gradient", "step time", "memory", "expert balance", "layers")
"""The escalation order of seeds 001 §1, then the layer views."""


class StepNotFound(LookupError):
    """The run or the step is not in the store."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One signal at the explained step, against its own baseline."""

    stage: str
    signal: str
    value: float | None
    baseline: float | None
    ratio: float | None  # value / baseline
    z: float | None  # robust score against the signal's own history
    culprit: str | None  # "rank 3", "source code", "layer 2 (layers.2.mlp)", ...
    moved: bool
    onset_step: int | None = None  # first step of the scanned stretch at which it had moved
    note: str = ""
    at: int | None = None  # the step value, baseline and z describe

    @property
    def size(self) -> float:
        """How far it moved: |z| where scored; a moved fact without a score (a missing rank,
        a replay that did not reproduce, a layer walk) ranks as infinite."""
        if self.z is not None:
            return abs(self.z) if not math.isnan(self.z) else math.inf
        return math.inf if self.moved else 0.0


@dataclass(frozen=True, slots=True)
class Page:
    """A page the stream sent at the explained step (its alert row), or an event at the step
    inside the episode of an earlier page (``episode_step``: that page's step)."""

    stage: str
    signal: str
    culprit: str
    value: float | None
    baseline: float | None
    z: float | None
    message: str
    finding: str | None = None  # the explain finding that shows the same signal
    episode_step: int | None = None


@dataclass(frozen=True, slots=True)
class Explanation:
    run_id: str
    step: int
    tokens: int
    scanned_from: int
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    pages: tuple[Page, ...] = field(default_factory=tuple)

    @property
    def ranked(self) -> list[Finding]:
        """Findings that moved, in the escalation order; within a stage, those moved at the
        explained step first, then by the size of the move there."""
        return sorted(
            (f for f in self.findings if f.moved),
            key=lambda f: (STAGES.index(f.stage), f.at not in (None, self.step), -f.size),
        )

    @property
    def moved(self) -> list[Finding]:
        return self.ranked

    @property
    def first(self) -> Finding | None:
        """The finding a person reads first: the one showing what paged at the step, else
        the top of ``ranked``."""
        for page in self.pages:
            named = next((f for f in self.findings if f.signal == page.finding), None)
            if named is not None:
                return named
        ranked = self.ranked
        return ranked[0] if ranked else None

    def headline(self) -> str:
        """One line: what paged (signal, stage, value against baseline, culprit), or else what
        moved most, earliest stage first."""
        if self.pages:
            p = self.pages[0]
            size = _fmt(p.value)
            if p.baseline is not None:
                size += f" vs baseline {_fmt(p.baseline)}"
            extras = [
                f"×{p.value / p.baseline:.3g}"
                if p.value is not None and p.baseline and math.isfinite(p.value)
                else "",
                f"z={p.z:.1f}" if p.z is not None and math.isfinite(p.z) else "",
            ]
            extras = [e for e in extras if e]
            if extras:
                size += f" ({', '.join(extras)})"
            shown = next((f for f in self.findings if f.signal == p.finding), None)
            culprit = p.culprit or (shown.culprit if shown is not None else "")
            who = f"; carried by {culprit}" if culprit else ""
            when = (
                f"at step {self.step}"
                if p.episode_step is None
                else f"at step {self.step} (inside the page episode of step {p.episode_step})"
            )
            also = sorted({q.signal for q in self.pages[1:]} - {p.signal})
            tail = f" Also paged: {', '.join(also)}." if also else ""
            return f"Paged {when}: {p.signal} ({p.stage}) {size}{who}.{tail}"
        f = self.first
        if f is None:
            return (
                f"Nothing moved against its own baseline in steps {self.scanned_from}–"
                f"{self.step}; open the layer views (tensor_view) next."
            )
        at = f.at if f.at is not None else self.step
        when = f"at step {at}"
        if f.onset_step is not None and f.onset_step < at:
            when += f", since step {f.onset_step}"
            if f.onset_step == self.scanned_from:
                when += " or before"
        size = _fmt(f.value)
        if f.baseline is not None:
            size += f" vs baseline {_fmt(f.baseline)}"
        extras = [
            f"×{f.ratio:.3g}" if f.ratio is not None else "",
            f"z={f.z:.1f}" if f.z is not None and math.isfinite(f.z) else "",
        ]
        extras = [e for e in extras if e]
        if extras:
            size += f" ({', '.join(extras)})"
        who = f"; carried by {f.culprit}" if f.culprit else ""
        return f"{f.signal} ({f.stage}) moved {when}: {size}{who}."


def _fmt(v: float | None) -> str:
    if v is None:
        return "–"
    return f"{v:.4g}" if math.isfinite(v) else str(v)
