"""`explain` on recorded runs with a known culprit: it names what moved first and who."""

from __future__ import annotations

import uuid

import pytest
from rich.console import Console

from probewire.deploy.explain import StepNotFound, explain, render
from probewire.sinks import ClickHouseSink
from probewire.sinks.testing import (BadRank, ExplodingLayer, RegressingSource, Straggler,
                                     recorded_run, write_recorded_run)

RUNS = {
    "clean": (),
    "bad-rank": (BadRank(3, 130, 1.5),),
    "regressing-source": (RegressingSource("math", 130, 0.02),),
    "exploding-layer": (ExplodingLayer(2, 130),),
    "straggler": (Straggler(1, 130, 2.0),),
}


@pytest.fixture(scope="module")
def store(ch_client):
    """One database with one recorded run per fault (and one with missing ranks)."""
    db = f"pw_test_{uuid.uuid4().hex[:10]}"
    sink = ClickHouseSink(ch_client, db)
    sink.migrate()
    for run_id, faults in RUNS.items():
        write_recorded_run(sink, recorded_run(run_id, steps=150, faults=faults))
    lossy = recorded_run("missing-rank", steps=150)
    for row in lossy.tables["step_metrics"]:
        if row["step"] >= 131:
            row.update(ranks_missing=[2], ranks_reporting=3, complete_reason="deadline")
    write_recorded_run(sink, lossy)
    yield ch_client, db
    ch_client.command(f"DROP DATABASE IF EXISTS {db}")


def _finding(explanation, signal):
    return next(f for f in explanation.findings if f.signal == signal)


def test_a_bad_rank_is_named_as_the_carrier_of_the_loss(store) -> None:
    result = explain(*store, "bad-rank", 133)
    assert result.first.signal == "loss" and result.first.onset_step == 130
    assert result.first.culprit == "rank 3"
    worst = _finding(result, "loss_worst_rank")
    assert worst.moved and worst.culprit == "rank 3" and worst.ratio == pytest.approx(1.33, 0.05)
    assert [f.stage for f in result.moved] == ["loss", "loss"]


def test_a_regressing_source_moves_first_under_a_flat_global_loss(store) -> None:
    result = explain(*store, "regressing-source", 138)
    assert result.first.signal == "source:math" and result.first.culprit == "source math"
    assert 130 <= result.first.onset_step <= 134
    assert not _finding(result, "loss").moved  # 5% of the tokens: L stays flat
    assert not _finding(result, "source:web").moved


def test_an_exploding_layer_is_localised_and_the_gradient_moved_before_the_loss(store) -> None:
    result = explain(*store, "exploding-layer", 130)
    assert result.first.signal == "grad_norm" and result.first.onset_step == 129
    assert result.first.culprit.startswith("layer 2 (layers.2.")
    layers = _finding(result, "bwd |g|max")
    assert layers.moved and layers.culprit.startswith("layer 2") and layers.ratio > 10
    assert _finding(result, "loss").onset_step == 130
    assert _finding(result, "cospike_count").moved
    assert "grad_norm (gradient) moved first, step 129 (1 step before 130)" in result.headline()


def test_a_straggler_is_named_by_the_step_time(store) -> None:
    result = explain(*store, "straggler", 132)
    assert result.first.signal == "step_time_s" and result.first.culprit == "rank 1"
    assert result.first.ratio == pytest.approx(2.0, rel=0.1)


def test_missing_ranks_come_first_in_the_escalation_order(store) -> None:
    result = explain(*store, "missing-rank", 133)
    assert result.first.signal == "ranks_missing" and result.first.culprit == "ranks 2"
    assert result.first.onset_step == 131
    assert _finding(result, "complete_reason").moved


def test_a_healthy_step_reports_that_nothing_moved(store) -> None:
    result = explain(*store, "clean", 140)
    assert result.first is None and result.moved == []
    assert result.headline().startswith("Nothing moved")
    assert [f.stage for f in result.findings][:2] == ["job state", "loss"]


def test_render_prints_every_finding_and_the_headline(store) -> None:
    console = Console(record=True, width=160)
    render(explain(*store, "exploding-layer", 130), console)
    text = console.export_text()
    for signal in ("ranks_missing", "loss_worst_rank", "grad_norm", "peak_memory_bytes",
                   "moe_maxvio", "bwd |g|max"):
        assert signal in text
    assert "carried by layer 2" in text


def test_an_unknown_step_or_run_says_what_exists(store) -> None:
    with pytest.raises(StepNotFound, match="it has steps 0–149"):
        explain(*store, "clean", 500)
    with pytest.raises(StepNotFound, match="no such run"):
        explain(*store, "nope", 5)


def test_a_store_of_the_version_1_schema_is_explained_without_the_newer_columns(store) -> None:
    """explain reads and never migrates: a store written before migration 2 lacks the
    structure and own-time columns; those signals read as not measured."""
    client, db = store
    old = f"{db}_v1"
    client.command(f"CREATE DATABASE IF NOT EXISTS {old}")
    client.command(f"CREATE TABLE {old}.step_metrics ENGINE = ReplacingMergeTree(inserted_at) "
                   f"ORDER BY (run_id, step) AS SELECT * EXCEPT (media_scale, "
                   "residual_ratio_min, residual_ratio_branch, residual_stream_norm, "
                   f"residual_branch_norm, straggler_own_ratio) FROM {db}.step_metrics")
    for table in ("source_metrics", "rank_metrics", "tensor_stats", "expert_balance"):
        client.command(f"CREATE VIEW {old}.{table} AS SELECT * FROM {db}.{table}")
    try:
        result = explain(client, old, "bad-rank", 133)
        assert result.first.signal == "loss" and result.first.culprit == "rank 3"
        assert {f.signal for f in result.findings}.isdisjoint(
            {"media_scale", "residual_ratio_min", "straggler_own_ratio"})
    finally:
        client.command(f"DROP DATABASE IF EXISTS {old}")
