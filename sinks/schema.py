"""ClickHouse schema of database ``probewire``, as ordered, idempotent migrations.

Every table is a ReplacingMergeTree on its natural key with ``inserted_at`` as the
version, so re-delivering the same rows leaves the deduplicated contents unchanged
(read with ``FINAL`` or through the views). Names are LowCardinality; labels are a
bounded, sorted ``k=v|k=v`` string so they can sit in the sort key.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MIGRATIONS", "Migration", "TABLE_COLUMNS"]


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


_V1 = Migration(1, "step and per-rank metrics", (
    """CREATE TABLE IF NOT EXISTS {db}.step_metrics (
        run_id LowCardinality(String),
        step UInt64,
        tokens UInt64,
        step_tokens UInt64,
        loss Nullable(Float64),
        loss_worst_rank Nullable(Float64),
        loss_worst_rank_id Nullable(UInt32),
        grad_norm Nullable(Float64),
        step_time_s Nullable(Float64),
        ranks_reporting UInt32,
        ranks_missing Array(UInt32),
        complete_reason LowCardinality(String),
        inserted_at DateTime64(6) DEFAULT now64(6)
    ) ENGINE = ReplacingMergeTree(inserted_at) ORDER BY (run_id, step)""",
    """CREATE TABLE IF NOT EXISTS {db}.rank_metrics (
        run_id LowCardinality(String),
        step UInt64,
        rank UInt32,
        metric LowCardinality(String),
        labels String,
        value Float64,
        late UInt8,
        inserted_at DateTime64(6) DEFAULT now64(6)
    ) ENGINE = ReplacingMergeTree(inserted_at) ORDER BY (run_id, step, metric, labels, rank)""",
))

MIGRATIONS: tuple[Migration, ...] = (_V1,)

# Columns the writer supplies for each table (``inserted_at`` is filled by the server).
TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "step_metrics": ("run_id", "step", "tokens", "step_tokens", "loss", "loss_worst_rank",
                     "loss_worst_rank_id", "grad_norm", "step_time_s", "ranks_reporting",
                     "ranks_missing", "complete_reason"),
    "rank_metrics": ("run_id", "step", "rank", "metric", "labels", "value", "late"),
}
