"""ClickHouseSink against an in-memory fake client: batching, column selection, retry policy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, DataError, OperationalError

from probewire.sinks import TABLE_COLUMNS, ClickHouseSink, RejectedRows, StoreUnavailable


class FakeClient:
    """Records column-oriented inserts; fails the first ``failures`` calls with ``error``."""

    def __init__(self, failures: int = 0, error: Exception | None = None) -> None:
        self.failures, self.error = failures, error
        self.inserts: list[tuple[str, list[str], list[list]]] = []
        self.calls = 0
        self.described: list[tuple[str, list[str]]] = []

    def create_insert_context(self, table, column_names):
        self.described.append((table, list(column_names)))
        return SimpleNamespace(column_types=[f"{table}.{c}" for c in column_names])

    def insert(self, table, data, column_names, column_types, column_oriented):
        self.calls += 1
        assert column_oriented is True
        assert column_types == [f"{table}.{c}" for c in column_names]
        if self.calls <= self.failures:
            raise self.error
        self.inserts.append((table, list(column_names), [list(c) for c in data]))


def _sink(client: FakeClient, **kw) -> tuple[ClickHouseSink, list[float]]:
    slept: list[float] = []
    return ClickHouseSink(client, "pw", sleep=slept.append, **kw), slept


def test_rows_are_sent_column_wise_with_only_the_columns_present() -> None:
    client = FakeClient()
    sink, _ = _sink(client)
    rows = [{"run_id": "r", "step": s, "tokens": 10 * s, "loss": 1.0 / (s + 1)} for s in range(3)]
    assert sink.write("step_metrics", rows) == 3
    [(table, columns, data)] = client.inserts
    assert table == "pw.step_metrics"
    assert columns == ["run_id", "step", "tokens", "loss"]  # table order, not dict order
    assert data == [["r", "r", "r"], [0, 1, 2], [0, 10, 20], [1.0, 0.5, 1.0 / 3]]


def test_a_tables_column_types_are_described_once_and_again_after_a_failed_insert() -> None:
    client = FakeClient(failures=1, error=OperationalError("connection refused"))
    sink, _ = _sink(client)
    rows = [{"run_id": "r", "step": 0, "tokens": 1}]
    for _ in range(3):
        sink.write("step_metrics", rows)
    sink.write("step_metrics", [{"run_id": "r", "step": 1, "loss": 2.0}])
    described = [("pw.step_metrics", ["run_id", "step", "tokens"])]
    # the retry after the failed first insert describes again; then the types are kept
    assert client.described == described * 2 + [("pw.step_metrics", ["run_id", "step", "loss"])]
    assert len(client.inserts) == 4


def test_rows_with_different_column_sets_go_into_separate_inserts() -> None:
    client = FakeClient()
    sink, _ = _sink(client)
    sink.write(
        "step_metrics",
        [
            {"run_id": "r", "step": 0, "tokens": 1},
            {"run_id": "r", "step": 1, "tokens": 2, "flops": 5.0},
        ],
    )
    assert sorted(c for _, c, _ in client.inserts) == [
        ["run_id", "step", "tokens"],
        ["run_id", "step", "tokens", "flops"],
    ]


def test_batches_are_split_at_batch_rows() -> None:
    client = FakeClient()
    sink, _ = _sink(client, batch_rows=4)
    rows = [
        {"run_id": "r", "step": s, "rank": 0, "metric": "m", "value": float(s)} for s in range(10)
    ]
    sink.write("rank_metrics", rows)
    assert [len(data[0]) for _, _, data in client.inserts] == [4, 4, 2]
    assert [v for _, _, data in client.inserts for v in data[1]] == list(range(10))


def test_write_columns_matches_write_rows() -> None:
    a, b = FakeClient(), FakeClient()
    rows = [
        {"run_id": "r", "step": s, "source": "web", "loss": 2.0, "token_share": 1.0, "tokens": 7}
        for s in range(5)
    ]
    _sink(a)[0].write("source_metrics", rows)
    _sink(b)[0].write_columns("source_metrics", {k: [r[k] for r in rows] for k in rows[0]})
    assert a.inserts == b.inserts


@pytest.mark.parametrize(
    "table,row",
    [
        ("step_metrics", {"run_id": "r", "step": 0, "no_such_column": 1}),
        ("no_such_table", {"run_id": "r"}),
    ],
)
def test_unknown_tables_and_columns_are_rejected_before_any_insert(table, row) -> None:
    client = FakeClient()
    sink, slept = _sink(client)
    with pytest.raises(RejectedRows):
        sink.write(table, [row])
    assert client.calls == 0 and slept == []


def test_an_unavailable_store_is_retried_with_growing_backoff_until_it_answers() -> None:
    client = FakeClient(failures=3, error=OperationalError("connection refused"))
    sink, slept = _sink(client)
    sink.write("runs", [{"run_id": "r", "world_size": 8}])
    assert slept == [0.1, 0.2, 0.4]
    assert sink.retries == 3
    assert client.inserts == [("pw.runs", ["run_id", "world_size"], [["r"], [8]])]


def test_a_store_down_for_longer_than_the_budget_raises_store_unavailable() -> None:
    client = FakeClient(
        failures=10**6, error=DatabaseError("Table pw.runs does not exist", code=60)
    )
    sink, slept = _sink(client, retry_max_s=1.0)
    with pytest.raises(StoreUnavailable):
        sink.write("runs", [{"run_id": "r", "world_size": 8}])
    assert sum(slept) >= 1.0 and client.inserts == []


@pytest.mark.parametrize(
    "error",
    [
        DataError("Invalid None value in non-Nullable column"),
        ValueError("invalid literal for int()"),
        DatabaseError("Type mismatch", code=53),
    ],
)
def test_rows_that_can_never_be_stored_are_not_retried(error) -> None:
    client = FakeClient(failures=1, error=error)
    sink, slept = _sink(client)
    with pytest.raises(RejectedRows):
        sink.write("runs", [{"run_id": "r", "world_size": 8}])
    assert slept == [] and client.calls == 1


def test_every_table_column_list_leaves_the_version_to_the_server() -> None:
    assert all("inserted_at" not in cols for cols in TABLE_COLUMNS.values())
    assert TABLE_COLUMNS["runs"][0] == "run_id" and "updated_at" in TABLE_COLUMNS["runs"]


def test_credentials_in_a_server_url_win_over_the_settings(monkeypatch) -> None:
    import clickhouse_connect

    from probewire.sinks import connect

    calls: list[dict] = []
    monkeypatch.setattr(clickhouse_connect, "get_client", lambda **kw: calls.append(kw))
    monkeypatch.setenv("PW_TEST_SECRET", "s3cret")
    connect("http://test:pw@db:8123", username="default", password_env="PW_TEST_SECRET")
    connect("https://db:8443", username="probewire", password_env="PW_TEST_SECRET")
    assert calls == [
        {"dsn": "http://test:pw@db:8123"},
        {"dsn": "https://db:8443", "username": "probewire", "password": "s3cret"},
    ]
