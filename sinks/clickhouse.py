"""The one writer into ClickHouse, for ``chdb:///abs/path`` (embedded) and ``http(s)://``.

Rows are inserted column-oriented in batches of at most ``batch_rows``. A failed insert
is retried with capped exponential backoff while the store is unavailable; the call
returns only once the rows are stored (or raises ``StoreUnavailable`` when the retry
budget is spent), so the stream commits Kafka offsets only for durable rows. Retrying
is safe because every table deduplicates on its natural key: a batch stored twice
reads back once. Rows that can never be stored (an unknown column, a value of the
wrong type) raise at once instead of being retried.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import clickhouse_connect
import pyarrow as pa
from clickhouse_connect.driver.exceptions import ClickHouseError, DataError, Error, ProgrammingError

from .schema import MIGRATIONS, RECENT_TABLES, SENSITIVE_ARTIFACTS, TABLE_COLUMNS, VIEWS
from .schema import sensitive_artifacts as _sensitive_table

__all__ = ["ClickHouseSink", "RejectedRows", "StoreUnavailable", "connect"]

log = logging.getLogger(__name__)

# Server error codes that describe the rows or the statement, not the store's health:
# retrying cannot help. 6 CANNOT_PARSE_TEXT, 16 NO_SUCH_COLUMN_IN_TABLE, 27
# CANNOT_PARSE_INPUT_ASSERTION_FAILED, 53 TYPE_MISMATCH, 62 SYNTAX_ERROR, 70
# CANNOT_CONVERT_TYPE, 117 INCORRECT_DATA, 349 CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN.
_PERMANENT_CODES = frozenset({6, 16, 27, 53, 62, 70, 117, 349})

# The look-back tables take every per-rank value of every step (most of the rows the
# stream writes) and are read only by promotion, which copies every stored version of a
# row (``retained.promote``) into a table whose readers deduplicate with FINAL. Their
# inserts skip the engine's merge of the block on insert (``optimize_on_insert``: a
# ReplacingMergeTree collapses the block's equal keys before writing the part), about half
# of the engine's CPU for such an insert; FINAL reads keep the same row (the block's last).
_NO_INSERT_MERGE = {"optimize_on_insert": 0}
_RECENT = frozenset(t.name for t in RECENT_TABLES)


class StoreUnavailable(RuntimeError):
    """The store could not be reached within the retry budget."""


class RejectedRows(ValueError):
    """The rows can never be stored as given (unknown table or column, wrong value type)."""


def connect(url: str, *, username: str = "default", password_env: str = "") -> Any:
    """A clickhouse-connect client for ``chdb:///abs/path`` or ``http(s)://host:port``.

    Credentials written into the URL (``http://user:secret@host:8123``) win; otherwise
    ``username`` and the password held by the environment variable ``password_env``.
    """
    if url.startswith("chdb:///"):
        os.makedirs(url[len("chdb://") :], exist_ok=True)
        client = clickhouse_connect.get_client(dsn=url)
        # an embedded connection still open at interpreter exit can crash the process in
        # the engine's static teardown (SIGSEGV after all work is done: chdb-core#177)
        atexit.register(client.close)
        return client
    parsed = urlparse(url)
    if parsed.username or parsed.password:
        return clickhouse_connect.get_client(dsn=url)
    password = os.environ.get(password_env, "") if password_env else ""
    return clickhouse_connect.get_client(dsn=url, username=username, password=password)


def _permanent(exc: BaseException) -> bool:
    if isinstance(exc, (DataError, TypeError, ValueError)):
        return True  # raised while serialising the rows on this side
    if isinstance(exc, ProgrammingError) and exc.code is None:
        return True  # rejected by the client before anything was sent
    return isinstance(exc, Error) and exc.code in _PERMANENT_CODES


@dataclass(slots=True)
class ClickHouseSink:
    """Batched, retried, idempotent inserts into database ``database``.

    ``retries`` counts failed attempts that were retried (for health reporting and tests).
    """

    client: Any
    database: str = "probewire"
    retry_max_s: float = 30.0
    sleep: Callable[[float], None] = time.sleep
    batch_rows: int = 50_000
    # the nice value (0-19) of the store's threads while they run this sink's inserts
    # (ClickHouse's ``os_thread_priority``): the detail writer's, which take the CPU that
    # the page path leaves
    nice: int = 0
    retries: int = field(default=0, init=False)
    # (table, columns) -> their ClickHouse types, described once: an insert without them
    # asks the store first (DESCRIBE TABLE, ~0.6 ms of a 2-4 ms small insert on chdb)
    _types: dict[tuple[str, tuple[str, ...]], Sequence[Any]] = field(
        default_factory=dict, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if not self.database.isidentifier():
            raise ValueError(f"database must be a plain identifier, got {self.database!r}")
        if self.batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {self.batch_rows!r}")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"nice must lie in [0, 19], got {self.nice!r}")

    def migrate(self, *, sensitive_artifacts: bool = False, sensitive_ttl_days: int = 7) -> int:
        """Create the database, apply pending migrations, recreate a table of the current
        version that is missing (dropped by hand), and (re)create the views.

        With ``sensitive_artifacts`` the opt-in table of raw samples and token traces is
        created (or its TTL updated to ``sensitive_ttl_days``); without it nothing is
        created, and an existing table is left as it is. Returns the schema version.
        """
        db = self.database
        self._command(f"CREATE DATABASE IF NOT EXISTS {db}")
        self._command(
            f"CREATE TABLE IF NOT EXISTS {db}.schema_migrations (version UInt32, "
            "description String, applied_at DateTime64(3) DEFAULT now64(3)) "
            "ENGINE = ReplacingMergeTree ORDER BY version"
        )
        applied = {
            row[0]
            for row in self._retry(
                lambda: (
                    self.client.query(
                        f"SELECT version FROM {db}.schema_migrations FINAL"
                    ).result_rows
                )
            )
        }
        for migration in MIGRATIONS:
            if migration.version in applied:
                continue
            for statement in migration.statements:
                self._command(statement.replace("{db}", db))
            self._retry(
                functools.partial(
                    self.client.insert,
                    f"{db}.schema_migrations",
                    [[migration.version, migration.description]],
                    column_names=["version", "description"],
                )
            )
        self._repair()
        if sensitive_artifacts:
            table = _sensitive_table(sensitive_ttl_days)
            self._command(table.ddl(db))
            self._command(f"ALTER TABLE {db}.{SENSITIVE_ARTIFACTS} MODIFY TTL {table.ttl}")
        for view in VIEWS:
            self._command(view.ddl(db))
        return max(m.version for m in MIGRATIONS)

    def _repair(self) -> None:
        """Recreate tables of the current version that are missing though their migration
        was applied (a table dropped by hand): every migration statement is idempotent
        (``IF NOT EXISTS``), so all of them are replayed in order."""
        db = self.database
        present = {
            row[0]
            for row in self._retry(
                lambda: (
                    self.client.query(
                        "SELECT name FROM system.tables WHERE database = {db:String}",
                        parameters={"db": db},
                    ).result_rows
                )
            )
        }
        missing = sorted(set(TABLE_COLUMNS) - {SENSITIVE_ARTIFACTS} - present)
        if not missing:
            return
        log.warning("schema of %s: recreating missing table(s) %s", db, ", ".join(missing))
        for migration in MIGRATIONS:
            for statement in migration.statements:
                self._command(statement.replace("{db}", db))

    def write(self, table: str, rows: Sequence[Mapping[str, Any]]) -> int:
        """Store rows (dicts keyed by column); returns how many. Blocks until stored.

        Each row may carry any subset of the table's columns; the others take their
        defaults. Rows with the same set of columns go into one column-oriented insert.
        """
        if not rows:
            return 0
        known = _known_columns(table)
        first = rows[0]
        if all(len(row) == len(first) for row in rows):
            try:  # the usual case: every row has the same columns
                self._write_group(table, known, first, rows)
                return len(rows)
            except KeyError:
                pass  # same width, different columns: group them below
        by_columns: dict[frozenset[str], list[Mapping[str, Any]]] = {}
        for row in rows:
            by_columns.setdefault(frozenset(row), []).append(row)
        for group in by_columns.values():
            self._write_group(table, known, group[0], group)
        return len(rows)

    def write_or_reject(
        self, table: str, rows: Sequence[Mapping[str, Any]]
    ) -> list[tuple[Mapping[str, Any], str]]:
        """Store every row that can be stored; return the others with the store's reason.

        A rejected write is bisected until the rows that cannot be stored (a value outside
        its column's type, say) stand alone, so one bad row never takes its batch down.
        Rows stored by an attempt that then failed are stored again: writes are idempotent.
        ``StoreUnavailable`` still propagates (retry the whole write later)."""
        if not rows:
            return []
        try:
            self.write(table, rows)
            return []
        except RejectedRows as exc:
            if len(rows) == 1:
                return [(rows[0], f"{table}: {exc}")]
        half = len(rows) // 2
        return self.write_or_reject(table, rows[:half]) + self.write_or_reject(table, rows[half:])

    def write_columns(self, table: str, columns: pa.Table | Mapping[str, Sequence[Any]]) -> int:
        """Store rows given column-wise (``{column: values}``, equal lengths, or an Arrow
        table typed as the store's columns: written as Arrow, no Python object per value);
        returns how many."""
        if isinstance(columns, pa.Table):
            return self._write_arrow(table, columns)
        known = _known_columns(table)
        unknown = set(columns) - set(known)
        if unknown:
            raise RejectedRows(f"{table}: unknown column(s) {sorted(unknown)}")
        lengths = {len(v) for v in columns.values()}
        if len(lengths) > 1:
            raise RejectedRows(f"{table}: columns of different lengths {sorted(lengths)}")
        n = lengths.pop() if lengths else 0
        names = [c for c in known if c in columns]
        for start in range(0, n, self.batch_rows):
            data = [columns[c][start : start + self.batch_rows] for c in names]
            self._insert(table, names, data)
        return n

    def _write_arrow(self, table: str, frame: pa.Table) -> int:
        unknown = set(frame.column_names) - set(_known_columns(table))
        if unknown:
            raise RejectedRows(f"{table}: unknown column(s) {sorted(unknown)}")
        name, settings = f"{self.database}.{table}", self._insert_settings(table)
        frame = frame.unify_dictionaries()  # batches appended (one dictionary per field)
        for start in range(0, frame.num_rows, self.batch_rows):
            part = frame.slice(start, self.batch_rows)
            self._retry(functools.partial(self.client.insert_arrow, name, part, settings=settings))
        return frame.num_rows

    def _write_group(
        self,
        table: str,
        known: tuple[str, ...],
        first: Mapping[str, Any],
        rows: Sequence[Mapping[str, Any]],
    ) -> None:
        """Rows that all carry ``first``'s columns (a KeyError says one does not)."""
        unknown = set(first) - set(known)
        if unknown:
            raise RejectedRows(
                f"{table}: unknown column(s) {sorted(unknown)}; known: {list(known)}"
            )
        names = [c for c in known if c in first]
        data = [[row[c] for row in rows] for c in names]  # all before any insert; > zip(*rows)
        for start in range(0, len(rows), self.batch_rows):
            self._insert(table, names, [column[start : start + self.batch_rows] for column in data])

    def _insert(self, table: str, columns: list[str], data: list[Sequence[Any]]) -> None:
        name, key = f"{self.database}.{table}", (table, tuple(columns))
        settings = self._insert_settings(table)
        extra = {"settings": settings} if settings else {}

        def insert() -> None:
            types = self._types.get(key)
            if types is None:
                types = self.client.create_insert_context(name, columns).column_types
                self._types[key] = types
            try:
                self.client.insert(
                    name,
                    data,
                    column_names=columns,
                    column_types=types,
                    column_oriented=True,
                    **extra,
                )
            except Exception:
                self._types.pop(key, None)  # a failed insert describes the table again
                raise

        self._retry(insert)

    def _insert_settings(self, table: str) -> dict[str, Any]:
        settings = dict(_NO_INSERT_MERGE) if table in _RECENT else {}
        if self.nice:
            settings["os_thread_priority"] = self.nice
        return settings

    def _command(self, sql: str) -> Any:
        return self._retry(lambda: self.client.command(sql))

    def _retry(self, action: Callable[[], Any]) -> Any:
        delay, waited = 0.1, 0.0
        while True:
            try:
                return action()
            except (ClickHouseError, OSError, TypeError, ValueError) as exc:
                if _permanent(exc):
                    raise RejectedRows(str(exc).strip().splitlines()[0]) from exc
                if waited >= self.retry_max_s:
                    raise StoreUnavailable(f"store unavailable after {waited:.1f}s: {exc}") from exc
                self.retries += 1
                log.warning(
                    "probewire sink: store call failed (%s); retrying in %.1fs",
                    str(exc).strip().splitlines()[0] if str(exc).strip() else exc,
                    delay,
                )
                self.sleep(delay)
                waited += delay
                delay = min(delay * 2, 5.0)


def lower_merge_priority(nice: int) -> int:
    """Lower the CPU priority of this process's embedded-store merge threads (chdb's
    ``MergeMutate`` pool, made when the engine starts) by ``nice``: merging the detail's
    millions of rows a scan step then takes the CPU that the page path leaves. Linux only
    (elsewhere nothing); returns how many threads it lowered."""
    lowered = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != "MergeMutate":
                    continue
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            lowered += 1
        except OSError:  # the thread ended meanwhile
            continue
    return lowered


def _known_columns(table: str) -> tuple[str, ...]:
    try:
        return TABLE_COLUMNS[table]
    except KeyError:
        raise RejectedRows(f"unknown table {table!r}; known: {sorted(TABLE_COLUMNS)}") from None
