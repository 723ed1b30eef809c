"""Stage 2's batch into the store: rows (one insert per table for all the batch's runs),
then promotion of retained detail, then each run's state, so a state row never names a
step whose rows are not stored. Runs in the writer thread; a row the store can never take
comes back (with the reason) instead of failing the batch, and ``StoreUnavailable`` /
``RejectedRows`` from promotion or state mean "retry the whole batch later"."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from probewire.sinks.clickhouse import ClickHouseSink, RejectedRows
from probewire.sinks.retained import promote, save_state

from .batching import Batch
from .stage2 import Stage2Output, column_rows
from .view import rank_table

__all__ = ["STATE_KEY", "write_batch"]

STATE_KEY = "stage2"


def write_batch(sink: ClickHouseSink, batch: Batch) -> list[tuple[str, Mapping[str, Any], str]]:
    """Write one batch, one insert per table for all its runs (an insert costs milliseconds
    however small); return the rejected rows as (run_id, row, reason)."""
    rows: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    owner: dict[int, str] = {}  # id(row) -> its run, for a rejected row's dead letter
    together = Stage2Output()
    for run_id, out in batch.outputs.items():
        for table, table_rows in out.rows.items():
            rows[table] += table_rows
            owner.update((id(row), run_id) for row in table_rows)
        for table, parts in out.columns.items():
            together.add_columns(table, parts)
    rejected = []
    for table, parts in together.columns.items():
        try:
            sink.write_columns(table, rank_table(parts))
        except RejectedRows:  # find the rows it cannot take, one by one if need be
            as_rows = column_rows(parts)
            rows[table] += as_rows
            owner.update((id(row), row["run_id"]) for row in as_rows)
    for table, table_rows in rows.items():
        rejected += [
            (owner[id(row)], row, reason) for row, reason in sink.write_or_reject(table, table_rows)
        ]
    for run_id, out in batch.outputs.items():
        promote(sink, run_id, sorted(set(out.promote)))
    for run_id, (step, state) in batch.states.items():
        save_state(sink, run_id, STATE_KEY, step, state)
    return rejected
