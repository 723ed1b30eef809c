"""The page gate: it deduplicates pages and never hides a finding.

Stage 2 records every finding (anomaly row, retention halo, cumulative counts) whatever
the gate decides. The first paging finding of a signal opens an episode and pages; a later
one inside the episode (no ``rearm_steps`` quiet steps in between) that starts a new event
(not on the step after the previous one) updates the page record, its event count and
latest step, instead of paging again; one on consecutive steps continues its event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .series import StepMetrics as SM

__all__ = ["Episode", "PageGate"]


class Paging(Protocol):
    """What the gate reads of a finding (``signals.Finding``)."""

    signal: str
    culprit: str


@dataclass(slots=True)
class Episode:
    """One page and the events it has seen: ``count`` events (runs of consecutive steps
    with a paging finding), the first at ``first_step``, the latest ending at
    ``last_step``; ``record`` is the page record stage 2 wrote (updated per event)."""

    first_step: int
    last_step: int
    count: int = 1
    new_event: bool = True
    record: dict[str, Any] | None = None


class PageGate:
    """Deduplicates pages; it never hides a finding (stage 2 records every one).

    Episodes are per signal; the worst-rank, per-source and per-rank shift losses have one
    per culprit (a second rank or source going bad is a second page). An episode ends after
    ``rearm_steps`` steps without a paging finding of its key."""

    def __init__(self, rearm_steps: int) -> None:
        self.rearm_steps = rearm_steps
        self.episodes: dict[str, Episode] = {}

    @staticmethod
    def key(finding: Paging) -> str:
        per_culprit = finding.signal in ("loss_by_source", SM.loss_worst_rank, "loss_rank_shift")
        return finding.signal + (f":{finding.culprit}" if per_culprit else "")

    def admit(self, step: int, finding: Paging) -> Episode:
        """The episode ``finding`` belongs to: a new one (``count`` 1: page), a new event of
        an open one (``new_event``: update the page record), or the continuation of its
        latest event (consecutive steps: nothing to send)."""
        key = self.key(finding)
        episode = self.episodes.get(key)
        if episode is None or step - episode.last_step > self.rearm_steps:
            episode = self.episodes[key] = Episode(first_step=step, last_step=step)
            return episode
        if step == episode.last_step:  # a second rule of the same signal at the same step
            episode.new_event = False
            return episode
        episode.new_event = step > episode.last_step + 1
        episode.count += episode.new_event
        episode.last_step = step
        return episode

    def to_state(self) -> dict[str, Any]:
        return {k: [e.first_step, e.last_step, e.count, e.record] for k, e in self.episodes.items()}

    @classmethod
    def from_state(cls, rearm_steps: int, state: Mapping[str, Any]) -> PageGate:
        gate = cls(rearm_steps)
        for key, saved in state.items():
            if isinstance(saved, int):  # a state from before episodes: the last page's step
                gate.episodes[key] = Episode(first_step=saved, last_step=saved)
            else:
                first, last, count, record = saved
                gate.episodes[key] = Episode(
                    first_step=int(first), last_step=int(last), count=int(count), record=record
                )
        return gate
