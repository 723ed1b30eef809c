"""Stage 2's batch write into the embedded store: one insert per table for all the batch's
runs, column batches stored as given, and a column batch's bad row dead-lettered alone."""

from __future__ import annotations

import pytest

from probewire.sinks.clickhouse import ClickHouseSink
from probewire.stream.batching import Batch
from probewire.stream.stage2 import Stage2Output
from probewire.stream.store import write_batch


class CountingSink(ClickHouseSink):
    """The real sink, counting its inserts per table."""

    __slots__ = ("inserts",)

    def _insert(self, table, columns, data):
        self.inserts[table] = self.inserts.get(table, 0) + 1
        super()._insert(table, columns, data)


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
        out.add_columns(
            "rank_metrics_recent",
            {
                "run_id": [run_id] * 2,
                "step": [step] * 2,
                "rank": [rank, 1],
                "metric": ["a", "b"],
                "labels": ["", "k=v"],
                "value": [step + 0.5, -1.0],
                "late": [0, 0],
            },
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


def test_a_bad_value_in_a_column_batch_is_rejected_alone_with_its_run(ch_client, sink):
    batch = Batch(outputs={"a": output("a", range(2)), "b": output("b", range(5, 6), rank=-3)})
    rejected = write_batch(sink, batch)  # rank -3 does not fit UInt32
    assert [(run, row["step"], row["rank"]) for run, row, _ in rejected] == [("b", 5, -3)]
    assert "rank_metrics_recent" in rejected[0][2]
    assert ch_client.query(
        f"SELECT run_id, step, rank FROM {sink.database}.rank_metrics_recent "
        "ORDER BY run_id, step, rank"
    ).result_rows == [("a", 0, 0), ("a", 0, 1), ("a", 1, 0), ("a", 1, 1), ("b", 5, 1)]


def test_a_column_batch_must_keep_its_columns():
    out = output("a", range(1))
    with pytest.raises(ValueError, match="rank_metrics_recent: column batch"):
        out.add_columns("rank_metrics_recent", {"run_id": ["a"], "step": [1]})
