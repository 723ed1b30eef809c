"""Tests for probewire.evaluators.scaling: a bound, not a point, outside the fit."""

from __future__ import annotations

import numpy as np
import pytest

from probewire.evaluators import scaling_report


def test_report_bounds_predictions_and_flags_extrapolation() -> None:
    tokens = np.geomspace(1e6, 1e8, 8)
    loss = 1.7 + 40.0 * tokens**-0.3
    loss = loss * (1 + 0.002 * np.random.default_rng(0).standard_normal(tokens.size))
    report = scaling_report(tokens, loss, [1e7, 1e9, 1e10])
    inside, far, farther = report.predictions
    assert (inside.extrapolated, far.extrapolated, farther.extrapolated) == (False, True, True)
    for p in report.predictions:
        assert p.low <= p.point <= p.high
        assert p.low <= 1.7 + 40.0 * p.x**-0.3 <= p.high  # the true law lies inside
    assert (far.high - far.low) > (inside.high - inside.low)
    assert (farther.high - farther.low) > (far.high - far.low)
    lines = report.lines()
    assert len(lines) == 4 and lines[2].endswith("(90%, extrapolated)")


def test_report_needs_enough_points() -> None:
    with pytest.raises(ValueError, match="at least 4 points"):
        scaling_report([1, 2, 3], [3.0, 2.0, 1.0], [10])
