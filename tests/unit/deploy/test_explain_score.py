"""explain's scoring on loaded data (no store): the stream's robust z with its spread floor,
and the ranking in the escalation order by the size of the move at the step."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probewire.deploy.explain.load import Loaded, StepData
from probewire.deploy.explain.model import Explanation, Finding, Page
from probewire.deploy.explain.score import score
from probewire.stream.detect import MIN_SPREAD, robust_z


def loaded(columns: dict[str, list], step: int, alerts: list[dict] | None = None) -> Loaded:
    n = len(next(iter(columns.values())))
    steps = np.arange(step - n + 1, step + 1)
    cols = {
        "step": list(steps),
        "ranks_missing": [[] for _ in steps],
        "complete_reason": ["all_ranks"] * n,
        "tokens": list(range(n)),
        **columns,
    }
    return Loaded("r", step, step - 10, StepData(steps, cols), alerts=alerts or [])


def test_a_constant_history_scores_a_move_against_the_floor_not_eps():
    """Peak memory held exactly constant, then 5% more: z is the stream's robust_z with the
    spread floored at 0.1% of the level (~33), not 715,506 (the old eps-sized spread)."""
    peak = [2.0e9] * 60 + [2.1e9]
    result = score(loaded({"peak_memory_bytes": peak}, 60))
    (memory,) = [f for f in result.findings if f.signal == "peak_memory_bytes"]
    expected = robust_z(math.log(2.1e9 + 1e-8) - math.log(2.0e9 + 1e-8), 0.0, MIN_SPREAD)
    assert memory.z == pytest.approx(expected, rel=1e-6) and 30 < memory.z < 40
    assert memory.moved and memory.at == 60


def finding(stage, signal, z, at=10, moved=True):
    return Finding(stage, signal, 1.0, 1.0, 1.0, z, None, moved, at, "", at)


def test_the_ranking_is_the_escalation_order_then_the_size_of_the_move_at_the_step():
    e = Explanation(
        "r",
        10,
        0,
        0,
        (
            finding("step time", "straggler_score", 40.0, at=3),  # an earlier blip, far away
            finding("gradient", "grad_norm", 9.0),
            finding("loss", "loss", 7.0),
            finding("loss", "loss_worst_rank", 25.0),
            finding("loss", "source:code", 50.0, at=8),  # moved, not at the step
            finding("memory", "peak_memory_bytes", 99.0, moved=False),
        ),
    )
    assert [f.signal for f in e.ranked] == [
        "loss_worst_rank",
        "loss",
        "source:code",
        "grad_norm",
        "straggler_score",
    ]
    assert e.first.signal == "loss_worst_rank"
    assert e.headline().startswith("loss_worst_rank (loss) moved at step 10")


def test_the_headline_names_what_paged_before_what_moved_most():
    paged = Page("gradient", "cospike", "", 5.0, 2.5, 9.0, "m", "grad_norm")
    e = Explanation(
        "r",
        10,
        0,
        0,
        (finding("loss", "loss", 30.0), finding("gradient", "grad_norm", 9.0)),
        (paged,),
    )
    assert e.first.signal == "grad_norm"
    assert e.headline().startswith("Paged at step 10: cospike (gradient) 5 vs baseline 2.5")
