"""The walking skeleton on real engines: 2 gloo ranks -> OTLP -> Kafka -> Faust -> ClickHouse."""

from __future__ import annotations

import json
import math
import os

import pytest

from probewire.deploy.demo.run import run_demo
from probewire.deploy.settings import ClickHouseSettings, Settings

pytestmark = pytest.mark.integration

STEPS = 40


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory: pytest.TempPathFactory, read_store):
    """Run the 2-rank demo once; return its per-step rows from ClickHouse and the rank traces."""
    base = tmp_path_factory.mktemp("skeleton")
    external = os.environ.get("CLICKHOUSE_URL")
    database = "pw_skeleton_" + base.name.replace("-", "_")[-12:]
    url = external or "chdb:///" + str(base / "store").lstrip("/")
    settings = Settings(clickhouse=ClickHouseSettings(url=url, database=database))
    result = run_demo(
        settings,
        ranks=2,
        steps=STEPS,
        work_dir=base / "run",
        trace=base / "trace",
        show_progress=False,
        bootstrap=os.environ.get("KAFKA_BOOTSTRAP"),
    )
    sql = (
        f"SELECT step, tokens, step_tokens, loss, loss_worst_rank, loss_worst_rank_id, "
        f"grad_norm, step_time_s, ranks_reporting FROM {database}.step_metrics FINAL "
        f"WHERE run_id = '{result.run_id}' ORDER BY step"
    )
    if external:
        from probewire.sinks.clickhouse import connect

        res = connect(external).query(sql)
        rows = [dict(zip(res.column_names, r)) for r in res.result_rows]
    else:
        rows = read_store(base / "store", sql)
    traces = {}
    for rank in (0, 1):
        lines = (base / "trace" / f"rank{rank}.jsonl").read_text().splitlines()
        traces[rank] = {rec["step"]: rec for rec in map(json.loads, lines)}
    return rows, traces


def test_every_step_is_stored_once_with_both_ranks(recorded_run):
    rows, _ = recorded_run
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert all(r["ranks_reporting"] == 2 for r in rows)


def test_loss_and_worst_rank_loss_equal_the_per_rank_components(recorded_run):
    rows, traces = recorded_run
    for row in rows:
        step = row["step"]
        sums = [traces[r][step]["loss_sum"] for r in (0, 1)]
        counts = [traces[r][step]["tokens"] for r in (0, 1)]
        expected_l = math.fsum(sums) / math.fsum(counts)
        means = [s / n for s, n in zip(sums, counts) if n > 0]
        assert row["loss"] == pytest.approx(expected_l, rel=1e-9, abs=0)
        assert row["loss_worst_rank"] == pytest.approx(max(means), rel=1e-9, abs=0)
        assert row["loss_worst_rank_id"] == max((0, 1), key=lambda r: sums[r] / counts[r])
        assert row["step_tokens"] == sum(counts)


def test_uneven_token_counts_make_mean_of_means_wrong(recorded_run):
    """The run has steps where the ranks' valid-token counts differ and the plain mean of the
    rank means is not L: the stream must (and does) report the token-weighted L."""
    rows, traces = recorded_run
    differing = []
    for row in rows:
        step = row["step"]
        sums = [traces[r][step]["loss_sum"] for r in (0, 1)]
        counts = [traces[r][step]["tokens"] for r in (0, 1)]
        mean_of_means = (sums[0] / counts[0] + sums[1] / counts[1]) / 2
        if counts[0] != counts[1] and abs(mean_of_means - row["loss"]) > 1e-6 * row["loss"]:
            differing.append(step)
    assert differing, "expected at least one step with unequal valid-token counts"


def test_grad_norm_is_one_replica_norm_returned_by_clip_grad_norm(recorded_run):
    """Both DP ranks hold the same all-reduced gradient; G2 counts one replica, not the sum."""
    rows, traces = recorded_run
    for row in rows:
        clip_norm = traces[0][row["step"]]["clip_total_norm"]
        assert traces[1][row["step"]]["clip_total_norm"] == pytest.approx(clip_norm, rel=1e-6)
        assert row["grad_norm"] == pytest.approx(clip_norm, rel=1e-9, abs=0)


def test_cumulative_tokens_and_step_time(recorded_run):
    rows, traces = recorded_run
    total = 0
    for row in rows:
        step = row["step"]
        total += sum(traces[r][step]["tokens"] for r in (0, 1))
        assert row["tokens"] == total
        expected_tau = max(traces[r][step]["step_time_s"] for r in (0, 1))
        assert row["step_time_s"] == pytest.approx(expected_tau, rel=1e-9, abs=0)
