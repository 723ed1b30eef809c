"""probewire.sinks: the ClickHouse schema and its one idempotent, batched writer."""

from .clickhouse import ClickHouseSink, RejectedRows, StoreUnavailable, connect
from .schema import MIGRATIONS, TABLE_COLUMNS, TABLES, VIEWS

__all__ = [
    "MIGRATIONS",
    "TABLES",
    "TABLE_COLUMNS",
    "VIEWS",
    "ClickHouseSink",
    "RejectedRows",
    "StoreUnavailable",
    "connect",
]
