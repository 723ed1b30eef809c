"""The simulated run speaks the demo's fault vocabulary and goes through the real stages."""

from __future__ import annotations

import numpy as np
import pytest

from probewire.deploy.demo.faults import Straggler
from probewire.deploy.demo.simulate import SIMULATED, simulated_run


def test_faults_are_the_demos_classes_or_their_command_line_texts():
    run = simulated_run(
        "s", steps=40, world_size=3, detector_window=10, faults=["bad-rank@30:rank=2"]
    )
    rows = {r["step"]: r for r in run.tables["step_metrics"]}
    for step, (loss, worst, _rank) in run.reference.items():  # float64 reference
        assert rows[step]["loss"] == pytest.approx(loss, rel=1e-12)
        assert rows[step]["loss_worst_rank"] == pytest.approx(worst, rel=1e-12)
    assert rows[35]["loss_worst_rank_id"] == 2
    assert rows[35]["loss_worst_rank"] == pytest.approx(np.log(256), rel=0.05)
    assert ("loss_worst_rank", "rank 2") in {
        (a["signal"], a["culprit"]) for a in run.tables["alerts"]
    }


def test_a_fault_it_cannot_simulate_is_refused_by_name():
    with pytest.raises(ValueError, match="flaky-replay: the simulator has no model of it"):
        simulated_run(steps=5, faults=["flaky-replay@3"])
    assert {cls.name for cls in SIMULATED} >= {"bad-rank", "straggler", "easy-batch"}


def test_a_simulated_straggler_is_synchronous_ddp():
    """Every rank's step time carries the delay; the own time names the slow rank."""
    run = simulated_run(
        "s",
        steps=40,
        world_size=4,
        detector_window=10,
        faults=[Straggler(rank=1, step=30, factor=2.0, duration=0)],
    )
    rows = {r["step"]: r for r in run.tables["step_metrics"]}
    assert all(rows[s]["straggler_rank"] == 1 for s in range(30, 40))
    assert all(rows[s]["straggler_score"] < 1.05 for s in range(30, 40))  # S ~ 1 under DDP
    assert rows[35]["straggler_own_ratio"] == pytest.approx(2.0, rel=0.1)
