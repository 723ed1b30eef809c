"""The sink against the real engine (chdb here; a server when CLICKHOUSE_URL is set)."""

from __future__ import annotations

import threading
import time

import pytest

from probewire.deploy.demo.faults import BadRank
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run
from probewire.sinks import ClickHouseSink, connect
from probewire.sinks.retained import promote
from probewire.sinks.schema import MIGRATIONS

pytestmark = pytest.mark.integration


@pytest.fixture()
def sink(ch_client, ch_database) -> ClickHouseSink:
    sink = ClickHouseSink(ch_client, ch_database, retry_max_s=20.0)
    sink.migrate()
    return sink


def _rank_rows(steps: range, value: float = 1.0) -> list[dict]:
    return [
        {
            "run_id": "run-a",
            "step": s,
            "rank": r,
            "metric": "step.duration",
            "labels": "",
            "value": value * (s + r / 10),
            "late": 0,
        }
        for s in steps
        for r in range(4)
    ]


def _contents(client, db: str, table: str = "rank_metrics", final: bool = True) -> list[tuple]:
    return client.query(
        f"SELECT step, rank, metric, labels, value, late FROM {db}.{table} "
        f"{'FINAL' if final else ''} ORDER BY step, rank"
    ).result_rows


def test_inserting_the_same_batch_twice_leaves_the_deduplicated_contents_unchanged(
    ch_client, sink
) -> None:
    batch = _rank_rows(range(50))
    sink.write("rank_metrics", batch)
    once = _contents(ch_client, sink.database)
    sink.write("rank_metrics", batch)
    assert _contents(ch_client, sink.database) == once
    assert len(once) == 200
    raw = ch_client.query(f"SELECT count() FROM {sink.database}.rank_metrics").result_rows
    assert raw == [(400,)]  # both copies were really written; FINAL reads one


def test_a_corrected_redelivery_replaces_the_earlier_row(ch_client, sink) -> None:
    sink.write("step_metrics", [{"run_id": "run-a", "step": 7, "tokens": 70, "loss": 3.0}])
    sink.write("step_metrics", [{"run_id": "run-a", "step": 7, "tokens": 70, "loss": 2.5}])
    got = ch_client.query(f"SELECT step, loss FROM {sink.database}.step_metrics FINAL")
    assert got.result_rows == [(7, 2.5)]


def test_the_sink_rides_out_a_store_outage_without_losing_or_duplicating_rows(
    ch_client, store_url, sink
) -> None:
    """The table is detached (inserts fail: UNKNOWN_TABLE) and re-attached 1 s later."""
    operator = connect(store_url)  # another client, as an operator would use
    table = f"{sink.database}.rank_metrics"
    sink.write("rank_metrics", _rank_rows(range(0, 10)))
    operator.command(f"DETACH TABLE {table}")
    restore = threading.Timer(1.0, lambda: operator.command(f"ATTACH TABLE {table}"))
    restore.start()
    started = time.monotonic()
    try:
        sink.write("rank_metrics", _rank_rows(range(10, 20)))  # blocks until stored
    finally:
        restore.join()
    assert time.monotonic() - started >= 0.9
    assert sink.retries >= 1
    sink.write("rank_metrics", _rank_rows(range(20, 30)))
    expected = [(s, r, "step.duration", "", s + r / 10, 0) for s in range(30) for r in range(4)]
    assert _contents(ch_client, sink.database) == expected
    assert _contents(ch_client, sink.database, final=False) == expected  # not even a copy


def test_first_screen_equals_the_values_reduced_by_the_stream(ch_client, sink) -> None:
    run = simulated_run("rec-1", steps=40, faults=(BadRank(rank=2, step=20),))
    write_simulated_run(sink, run)
    columns = (
        "step",
        "tokens",
        "loss",
        "loss_worst_rank",
        "loss_worst_rank_id",
        "grad_norm",
        "clip_rate",
        "cospike_count",
        "step_time_s",
        "tokens_per_s",
        "compute_rate",
        "straggler_score",
        "peak_memory_bytes",
        "moe_maxvio",
        "output_absmax",
    )
    got = ch_client.query(
        f"SELECT {', '.join(columns)} FROM {sink.database}.first_screen "
        "WHERE run_id = 'rec-1' ORDER BY step"
    ).result_rows
    assert got == [tuple(row[c] for c in columns) for row in run.tables["step_metrics"]]
    # and the stream's reduction equals a float64 reference from the rank components
    for step, loss, worst, worst_rank in ((r[0], r[2], r[3], r[4]) for r in got):
        ref_loss, ref_worst, ref_rank = run.reference[step]
        assert loss == pytest.approx(ref_loss, rel=1e-12)
        assert worst == pytest.approx(ref_worst, rel=1e-12) and worst_rank == ref_rank
    assert [r[4] for r in got[20:]] == [2] * 20  # the bad rank carries L_max


def test_retained_detail_is_promoted_and_matches_the_step_values(ch_client, sink) -> None:
    """L recomputed in SQL from the promoted per-rank components equals the view's L."""
    run = simulated_run("rec-2", steps=30, retain_every=10)
    write_simulated_run(sink, run)
    db = sink.database
    got = ch_client.query(f"""
        SELECT f.step, f.loss, r.loss FROM {db}.first_screen AS f
        INNER JOIN (SELECT step, sumIf(value, metric = 'loss.sum' AND labels = '')
                                 / sumIf(value, metric = 'loss.tokens' AND labels = '') AS loss
                    FROM {db}.rank_metrics FINAL WHERE run_id = 'rec-2' GROUP BY step) AS r
            ON f.step = r.step
        WHERE f.run_id = 'rec-2' ORDER BY f.step""").result_rows
    assert [s for s, _, _ in got] == run.promote
    assert {0, 10, 20, 29} <= set(run.promote)
    for _, view, components in got:
        assert view == pytest.approx(components, rel=1e-12)


def test_promotion_keeps_the_latest_version_of_each_row(ch_client, sink) -> None:
    """A look-back row rewritten with another value (a corrected redelivery) reaches the detail
    table as its latest version, whether its step was promoted before the rewrite and again
    after it (step 1) or only once both versions were stored (step 3: the look-back table
    holds both until it merges, and both are copied); promoting again changes nothing."""
    db = sink.database
    sink.write("rank_metrics_recent", _rank_rows(range(6)))
    promote(sink, "run-a", [1])
    sink.write("rank_metrics_recent", _rank_rows(range(6), value=2.0))
    promote(sink, "run-a", [1, 3])
    promote(sink, "run-a", [3])
    latest = [r for r in _contents(ch_client, db, "rank_metrics_recent") if r[0] in (1, 3)]
    assert [(step, rank, value) for step, rank, _, _, value, _ in latest] == [
        (s, r, 2.0 * (s + r / 10)) for s in (1, 3) for r in range(4)
    ]
    assert _contents(ch_client, db) == latest


def test_migrate_recreates_a_table_dropped_by_hand(sink, ch_client, ch_database):
    """A table of the current version dropped after its migration was applied comes back,
    with its current columns, when migrate runs again; the other tables keep their rows."""
    ch_client.insert(
        f"{ch_database}.runs",
        [["kept", 2, "running"]],
        column_names=["run_id", "world_size", "status"],
    )
    columns = ch_client.query(f"DESCRIBE TABLE {ch_database}.step_metrics").result_rows
    ch_client.command(f"DROP TABLE {ch_database}.step_metrics")
    assert sink.migrate() == max(m.version for m in MIGRATIONS)
    assert ch_client.query(f"DESCRIBE TABLE {ch_database}.step_metrics").result_rows == columns
    assert ch_client.query(f"SELECT run_id FROM {ch_database}.runs FINAL").result_rows == [
        ("kept",)
    ]
