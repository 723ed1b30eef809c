"""The one writer into ClickHouse, for ``chdb:///abs/path`` (embedded) and ``http(s)://``.

Rows are inserted column-oriented in batches; a failed insert is retried with capped
exponential backoff (the caller does not move on, so Kafka offsets are committed only
after the write is durable). Re-inserting a batch is harmless: tables deduplicate on
their natural key.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import clickhouse_connect
from clickhouse_connect.driver.exceptions import ClickHouseError

from .schema import MIGRATIONS, TABLE_COLUMNS

__all__ = ["ClickHouseSink", "StoreUnavailable", "connect"]

log = logging.getLogger(__name__)


class StoreUnavailable(RuntimeError):
    """The store could not be reached within the retry budget."""


def connect(url: str, *, username: str = "default", password_env: str = "") -> Any:
    """A clickhouse-connect client for ``chdb:///abs/path`` or ``http(s)://host:port``."""
    if url.startswith("chdb:///"):
        os.makedirs(url[len("chdb://"):], exist_ok=True)
        return clickhouse_connect.get_client(dsn=url)
    password = os.environ.get(password_env, "") if password_env else ""
    return clickhouse_connect.get_client(dsn=url, username=username, password=password)


@dataclass(slots=True)
class ClickHouseSink:
    """Batched, retried, idempotent inserts into database ``database``."""

    client: Any
    database: str = "probewire"
    retry_max_s: float = 30.0
    sleep: Callable[[float], None] = time.sleep

    def migrate(self) -> int:
        """Create the database and apply pending migrations; returns the schema version."""
        db = self.database
        self.client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
        self.client.command(
            f"CREATE TABLE IF NOT EXISTS {db}.schema_migrations (version UInt32, "
            "description String, applied_at DateTime64(3) DEFAULT now64(3)) "
            "ENGINE = ReplacingMergeTree ORDER BY version")
        applied = {row[0] for row in self.client.query(
            f"SELECT version FROM {db}.schema_migrations FINAL").result_rows}
        for migration in MIGRATIONS:
            if migration.version in applied:
                continue
            for statement in migration.statements:
                self.client.command(statement.format(db=db))
            self.client.insert(f"{db}.schema_migrations",
                               [[migration.version, migration.description]],
                               column_names=["version", "description"])
        return max(m.version for m in MIGRATIONS)

    def write(self, table: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Insert rows (dicts keyed by column) as one column-oriented batch; retry until stored."""
        if not rows:
            return 0
        columns = TABLE_COLUMNS[table]
        data = [[row[c] for row in rows] for c in columns]
        self._retry(lambda: self.client.insert(f"{self.database}.{table}", data,
                                               column_names=list(columns), column_oriented=True))
        return len(rows)

    def _retry(self, action: Callable[[], Any]) -> Any:
        delay, waited = 0.1, 0.0
        while True:
            try:
                return action()
            except (ClickHouseError, OSError, RuntimeError) as exc:
                if waited >= self.retry_max_s:
                    raise StoreUnavailable(f"store unavailable after {waited:.1f}s: {exc}") from exc
                log.warning("probewire sink: insert failed (%s); retrying in %.1fs", exc, delay)
                self.sleep(delay)
                waited += delay
                delay = min(delay * 2, 5.0)
