"""Stage 2's batch write into the embedded store: one insert per table for all the batch's
runs, column batches (Arrow) stored as given, and a column batch the store refuses stored
row by row, each row it cannot take dead-lettered with its run."""

from __future__ import annotations

import numpy as np
import pytest

from probewire.sinks.clickhouse import ClickHouseSink
from probewire.stream.batching import Batch
from probewire.stream.records import RankMatrix
from probewire.stream.stage2 import Stage2Output
from probewire.stream.store import write_batch
from probewire.stream.view import RankRows


class CountingSink(ClickHouseSink):
    """The real sink, counting its inserts per table."""

    __slots__ = ("inserts",)

    def _insert(self, table, columns, data):
        self.inserts[table] = self.inserts.get(table, 0) + 1
        super()._insert(table, columns, data)

    def _write_arrow(self, table, frame):
        self.inserts[table] = self.inserts.get(table, 0) + 1
        return super()._write_arrow(table, frame)


@pytest.fixture()
def sink(ch_client, ch_database) -> CountingSink:
    sink = CountingSink(ch_client, ch_database)
    sink.migrate()
    sink.inserts = {}
    return sink


def output(run_id: str, steps: range, rank: int = 0) -> Stage2Output:
    out = Stage2Output()
    for step in steps:
        out.rows["step_metrics"].append({"run_id": run_id, "step": step, "tokens": 10 * step})
        keys = [("a", ()), ("b", (("k", "v"),))]
        values = np.array([[step + 0.5, np.nan], [np.nan, -1.0]])
        mask = np.array([[1, 0], [0, 1]], np.uint8)  # rank ``rank`` sent a, rank 1 sent b
        out.add_columns(
            "rank_metrics_recent",
            [RankRows(run_id, step, 0, RankMatrix(keys, [rank, 1], values, mask))],
        )
    return out


def test_two_runs_are_one_insert_per_table_and_every_value_is_stored(ch_client, sink):
    batch = Batch(outputs={"a": output("a", range(3)), "b": output("b", range(10, 12))})
    assert write_batch(sink, batch) == []
    assert sink.inserts == {"step_metrics": 1, "rank_metrics_recent": 1}
    db = sink.database
    got = ch_client.query(
        f"SELECT run_id, step, rank, metric, labels, value, late FROM "
        f"{db}.rank_metrics_recent ORDER BY run_id, step, rank"
    ).result_rows
    runs = (("a", range(3)), ("b", range(10, 12)))
    assert got == [
        (r, s, k, m, lab, v, 0)
        for r, steps in runs
        for s in steps
        for k, m, lab, v in ((0, "a", "", s + 0.5), (1, "b", "k=v", -1.0))
    ]
    assert ch_client.query(
        f"SELECT run_id, step, tokens FROM {db}.step_metrics ORDER BY run_id, step"
    ).result_rows == [("a", 0, 0), ("a", 1, 10), ("a", 2, 20), ("b", 10, 100), ("b", 11, 110)]


def test_a_column_batch_the_store_refuses_is_dead_lettered_row_by_row_with_its_run(ch_client, sink):
    """A typed batch can only be refused whole (here the store lost a column the batch
    carries): it is tried row by row, and each row comes back with its run and the store's
    reason, none lost silently; the batch's other tables are stored."""
    ch_client.command(f"ALTER TABLE {sink.database}.rank_metrics_recent DROP COLUMN late")
    batch = Batch(outputs={"a": output("a", range(2)), "b": output("b", range(5, 6))})
    rejected = write_batch(sink, batch)
    assert sorted((run, row["step"], row["rank"]) for run, row, _ in rejected) == [
        ("a", 0, 0),
        ("a", 0, 1),
        ("a", 1, 0),
        ("a", 1, 1),
        ("b", 5, 0),
        ("b", 5, 1),
    ]
    assert all("rank_metrics_recent" in reason for _, _, reason in rejected)
    assert ch_client.query(
        f"SELECT run_id, step FROM {sink.database}.step_metrics ORDER BY run_id, step"
    ).result_rows == [("a", 0), ("a", 1), ("b", 5)]
