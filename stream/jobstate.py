"""The ``job_state`` page: a run whose ranks all went silent while it had not ended.

Stage 2 calls ``stall_alert`` once per silence (``RunPipeline.expire``): the run announced
itself (a lifecycle event) and has said neither ``finished`` nor ``crashed``, and no rank
has sent a step for ``stream.stage2.run_idle_s``. The page names the last step and the
ranks last heard from; a later step returns the run to ``running``. Pure: no Kafka, no
store.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .signals import Category, next_steps

__all__ = ["JOB_STATE", "stall_alert"]

JOB_STATE = "job_state"


def _ranks_text(ranks: list[int]) -> str:
    """``0-3, 7`` for ranks 0, 1, 2, 3 and 7 (runs of consecutive ranks joined)."""
    parts: list[tuple[int, int]] = []
    for r in ranks:
        if parts and parts[-1][1] == r - 1:
            parts[-1] = (parts[-1][0], r)
        else:
            parts.append((r, r))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in parts) or "none"


def stall_alert(
    run_id: str, last_step: int, ranks: Iterable[int], silent_s: float, tokens: int
) -> dict[str, Any]:
    """The ``alerts`` row of a stalled run (key: run, last step, ``job_state``)."""
    heard = sorted(set(ranks))
    return {
        "run_id": run_id,
        "step": last_step,
        "signal": JOB_STATE,
        "severity": "page",
        "culprit": "",
        "value": float(silent_s),
        "baseline": None,
        "z": None,
        "tokens": tokens,
        "ranks": heard,
        "message": (
            f"{JOB_STATE} stalled: no step from any rank for {silent_s:.0f}s after step "
            f"{last_step} (last heard from rank(s) {_ranks_text(heard)} at that step); the "
            "run has not finished or crashed: a hang, dead ranks, or a pause longer than "
            "stream.stage2.run_idle_s"
        ),
        "next_steps": next_steps(Category.JOB),
    }
