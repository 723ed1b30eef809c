"""`explain` on recorded runs with a known culprit: it names what moved first and who."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
from rich.console import Console

from probewire.deploy.demo.faults import BadRank, LayerExplosion, SourceRegression, Straggler
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run
from probewire.deploy.explain import StepNotFound, explain, render
from probewire.sinks import ClickHouseSink

RUNS = {
    "clean": (),
    "bad-rank": (BadRank(rank=3, step=130),),
    "regressing-source": (SourceRegression(source="math", step=130, per_step=0.02),),
    "exploding-layer": (LayerExplosion(layer=2, step=130, scale=50.0),),
    "straggler": (Straggler(rank=1, step=130, factor=2.0, duration=0),),
    "straggler-1.5": ("straggler@130:rank=2,factor=1.5,duration=0",),  # a demo --fault text
}


@pytest.fixture(scope="module")
def store(ch_client):
    """One database with one recorded run per fault (and one with missing ranks)."""
    db = f"pw_test_{uuid.uuid4().hex[:10]}"
    sink = ClickHouseSink(ch_client, db)
    sink.migrate()
    for run_id, faults in RUNS.items():
        write_simulated_run(sink, simulated_run(run_id, steps=150, faults=faults))
    lossy = simulated_run("missing-rank", steps=150)
    for row in lossy.tables["step_metrics"]:
        if row["step"] >= 131:
            row.update(ranks_missing=[2], ranks_reporting=3, complete_reason="deadline")
    write_simulated_run(sink, lossy)
    yield ch_client, db
    ch_client.command(f"DROP DATABASE IF EXISTS {db}")


def _finding(explanation, signal):
    return next(f for f in explanation.findings if f.signal == signal)


def test_at_a_bad_rank_page_the_headline_names_the_loss_and_the_rank(store) -> None:
    """The bad rank's own loss jumps to ln 256 (random bytes) at 130: loss_worst_rank pages
    (the sources that rank holds move too, recorded without a page: the rank carries it);
    the headline names the loss and the rank, its own loss against its own baseline."""
    result = explain(*store, "bad-rank", 130)
    assert [p.signal for p in result.pages] == ["loss_worst_rank"]
    page = result.pages[0]
    assert page.culprit == "rank 3" and page.value == pytest.approx(np.log(256), rel=0.03)
    headline = result.headline()
    assert headline.startswith("Paged at step 130: loss_worst_rank (loss)")
    assert "carried by rank 3" in headline
    assert result.first.signal == "loss_worst_rank" and result.first.culprit == "rank 3"
    assert [f.stage for f in result.ranked][:2] == ["loss", "loss"]


def test_after_the_page_the_loss_stage_still_names_the_rank(store) -> None:
    """Three steps on, the rank is still bad: an event inside the page's episode."""
    result = explain(*store, "bad-rank", 133)
    assert [(p.signal, p.episode_step) for p in result.pages][:1] == [("loss_worst_rank", 130)]
    assert "inside the page episode of step 130" in result.headline()
    assert result.first.stage == "loss" and result.first.culprit == "rank 3"
    assert result.first.onset_step == 130
    worst = _finding(result, "loss_worst_rank")
    ref = np.log(256) / ((3 * 2.26 + np.log(256)) / 4)  # L_max / L: 4 ranks, one at ln 256
    assert worst.moved and worst.culprit == "rank 3" and worst.ratio == pytest.approx(ref, 0.1)
    assert {f.stage for f in result.ranked} <= {"loss", "gradient"}


def test_a_regressing_source_moves_under_a_flat_global_loss(store) -> None:
    result = explain(*store, "regressing-source", 138)
    assert result.first.signal == "source:math" and result.first.culprit == "source math"
    assert 130 <= result.first.onset_step <= 134
    assert not _finding(result, "loss").moved  # 5% of the tokens: L stays flat
    assert not _finding(result, "source:web").moved


def test_an_exploding_layer_is_localised_at_its_cospike_page(store) -> None:
    result = explain(*store, "exploding-layer", 130)
    assert result.pages[0].signal == "cospike"
    layers = _finding(result, "bwd |g|max")
    assert layers.moved and layers.culprit.startswith("layer 2") and layers.ratio > 10
    assert _finding(result, "grad_norm").moved and _finding(result, "grad_norm").at == 130
    assert result.first.signal == "cospike_count" and result.first.culprit.startswith("layer 2")
    # the page carries no culprit (the step is the culprit); the walk names the layer
    assert result.headline().startswith("Paged at step 130: cospike (gradient)")
    assert "carried by layer 2 (layers.2." in result.headline()


@pytest.mark.parametrize("run_id, rank, slower", [("straggler", 1, 2.0), ("straggler-1.5", 2, 1.5)])
def test_a_straggler_is_named_by_its_own_time(store, run_id, rank, slower) -> None:
    """Synchronous DDP: every rank's step time carries the delay; the own time names it."""
    result = explain(*store, run_id, 132)
    assert result.first.stage == "step time" and result.first.culprit == f"rank {rank}"
    own = _finding(result, "straggler_own_ratio")
    assert own.moved and own.value == pytest.approx(slower, rel=0.1)
    step_time = _finding(result, "step_time_s")
    assert f"rank {rank}: own time" in step_time.note


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
    for signal in (
        "ranks_missing",
        "loss_worst_rank",
        "grad_norm",
        "peak_memory_bytes",
        "moe_maxvio",
        "bwd |g|max",
    ):
        assert signal in text
    assert "carried by layer 2" in text
    assert "▶ cospike_count" in text and "paged: cospike" in text


def test_render_on_a_narrow_terminal_wraps_cells_instead_of_cutting_them(store) -> None:
    console = Console(record=True, width=60, force_terminal=True)
    render(explain(*store, "exploding-layer", 130), console)
    text = console.export_text()
    assert "…" not in text  # rich's default cuts a cell to "3.801e+…" at this width
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
    client.command(
        f"CREATE TABLE {old}.step_metrics ENGINE = ReplacingMergeTree(inserted_at) "
        f"ORDER BY (run_id, step) AS SELECT * EXCEPT (media_scale, "
        "residual_ratio_min, residual_ratio_branch, residual_stream_norm, "
        f"residual_branch_norm, straggler_own_ratio) FROM {db}.step_metrics"
    )
    for table in (
        "source_metrics",
        "rank_metrics",
        "tensor_stats",
        "expert_balance",
        "alerts",
        "anomalies",
    ):
        client.command(f"CREATE VIEW {old}.{table} AS SELECT * FROM {db}.{table}")
    try:
        result = explain(client, old, "bad-rank", 133)
        assert result.first.stage == "loss" and result.first.culprit == "rank 3"
        assert {f.signal for f in result.findings}.isdisjoint(
            {"media_scale", "residual_ratio_min", "straggler_own_ratio"}
        )
    finally:
        client.command(f"DROP DATABASE IF EXISTS {old}")
