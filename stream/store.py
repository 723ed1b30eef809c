"""Stage 2's batch into the store: rows, then promotion of retained detail, then each run's
state, so a state row never names a step whose rows are not stored. Runs in the writer
thread; a row the store can never take comes back (with the reason) instead of failing
the batch, and ``StoreUnavailable`` / ``RejectedRows`` from promotion or state mean
"retry the whole batch later"."""

from __future__ import annotations

from typing import Any, Mapping

from probewire.sinks.clickhouse import ClickHouseSink
from probewire.sinks.retained import promote, save_state

from .batching import Batch

__all__ = ["STATE_KEY", "write_batch"]

STATE_KEY = "stage2"


def write_batch(sink: ClickHouseSink, batch: Batch) -> list[tuple[str, Mapping[str, Any], str]]:
    """Write one batch; return the rejected rows as (run_id, row, reason)."""
    rejected = []
    for run_id, out in batch.outputs.items():
        for table, rows in out.rows.items():
            rejected += [(run_id, row, reason) for row, reason in sink.write_or_reject(table,
                                                                                     rows)]
    for run_id, out in batch.outputs.items():
        promote(sink, run_id, sorted(set(out.promote)))
    for run_id, (step, state) in batch.states.items():
        save_state(sink, run_id, STATE_KEY, step, state)
    return rejected
