"""The held-out BPB rise rule (``stream.heldout``) and stage 2's path for evaluations
(``RunPipeline.on_evaluations``): a reference BPB that rises past the median of its suite's
last evaluations pages naming the suite, its baseline and its value; a falling or flat
BPB, another metric, a non-reference stream and a re-delivered evaluation do not; the
state survives a round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from probewire.deploy.explain.model import STAGES
from probewire.deploy.explain.score import PAGE_FINDINGS
from probewire.stream.findings import DetectorConfig
from probewire.stream.heldout import HeldoutRise
from probewire.stream.stage2 import RunPipeline, Stage2Config

CFG = DetectorConfig()


def row(step: int, value: float, **kw) -> dict:
    return {
        "run_id": "r",
        "step": step,
        "suite": "heldout",
        "metric": "bpb",
        "value": value,
        "reference": 1,
        **kw,
    }


def falling(n: int) -> list[float]:
    """A BPB curve that falls then flattens: 1.0 + 0.5 exp(-i / 4)."""
    return [1.0 + 0.5 * float(np.exp(-i / 4)) for i in range(n)]


def findings(values, restart: int | None = None, **kw) -> list[tuple]:
    rule, out = HeldoutRise(CFG), []
    for i, v in enumerate(values):
        if i == restart:
            rule = HeldoutRise(CFG, json.loads(json.dumps(rule.to_state())))
        f = rule.observe(row(100 * i, v, **kw))
        if f is not None:
            assert PAGE_FINDINGS[f.signal][0] == STAGES[f.category]
            out.append((i, f.signal, f.kind, f.value, f.baseline, f.culprit))
    return out


def test_a_falling_or_flat_bpb_finds_nothing():
    assert findings(falling(30)) == []
    assert findings([1.2] * 30) == []
    assert findings(falling(30), restart=12) == []


def test_a_rise_past_the_median_of_the_last_evaluations_pages_naming_the_suite():
    values = falling(12) + [1.3]
    (got,) = findings(values)
    base = float(np.median(values[-6:-1]))  # the 5 evaluations before it
    assert got[:3] == (12, "heldout_bpb", "rise") and got[5] == "suite heldout"
    assert got[3] == 1.3 and got[4] == base
    # the same after a state round trip midway
    assert findings(values, restart=7) == [got]
    # a rise smaller than heldout_bpb_rise (2 %) over that baseline is not one
    assert findings(falling(12) + [base * 1.015]) == []


def test_a_nonfinite_bpb_pages_and_stays_out_of_the_baseline():
    got = findings(falling(8) + [float("nan"), falling(9)[-1]])
    assert [(g[0], g[2]) for g in got] == [(8, "nonfinite")]


@pytest.mark.parametrize(
    "kw", [{"metric": "nll"}, {"reference": 0}], ids=["another metric", "not the reference"]
)
def test_only_the_reference_bpb_is_scored(kw):
    assert findings(falling(12) + [1.3], **kw) == []


def test_fewer_than_min_history_evaluations_or_a_redelivery_finds_nothing():
    assert findings([1.0, 1.0, 2.0]) == []  # the third: 2 values of history
    rule = HeldoutRise(CFG)
    for step, v in ((0, 1.0), (100, 1.0), (200, 1.0)):
        assert rule.observe(row(step, v)) is None
    assert rule.observe(row(200, 2.0)) is None  # a step the suite has: a re-delivery
    assert rule.observe(row(300, 2.0)) is not None


def test_stage2_pages_a_bpb_rise_once_with_its_suite_baseline_and_value():
    run = RunPipeline("r", Stage2Config())
    values = falling(10) + [1.4, 1.45]
    rows = [row(100 * i, v) for i, v in enumerate(values)]
    out = run.on_evaluations(rows[::-1])  # any order within a batch: scored by step
    (alert,) = out.rows["alerts"]
    base = float(np.median(values[5:10]))
    assert (alert["step"], alert["signal"], alert["culprit"]) == (
        1000,
        "heldout_bpb",
        "suite heldout",
    )
    assert (alert["value"], alert["baseline"]) == (1.4, base)
    assert alert["message"] == (
        f"heldout_bpb rise at step 1000: 1.4 bits/byte against baseline {base:.4g} bits/byte; "
        "carried by suite heldout"
    )
    assert [(a["step"], a["kind"]) for a in out.rows["anomalies"]] == [
        (1000, "rise"),
        (1100, "rise"),
    ]  # the second is the same episode: recorded, not paged again
    state = json.loads(json.dumps(run.to_state()))
    again = RunPipeline.from_state("r", Stage2Config(), state, 0.0)
    assert again.on_evaluations(rows).rows["alerts"] == []  # re-delivered: already scored
