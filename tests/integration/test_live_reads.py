"""Live reads of an embedded store while another process owns it: the owner's read-only
ClickHouse HTTP endpoint (``sinks.readserver``) answers clickhouse-connect and curl-style
requests; ``probewire sql`` finds it by itself, and without it says in one line which
process holds the store."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from probewire.sinks.readserver import READER_FILE, ReadServer, find_reader

pytestmark = pytest.mark.integration


@pytest.fixture()
def chdb_path(store_url: str) -> Path:
    if not store_url.startswith("chdb:///"):
        pytest.skip("the live reader serves an embedded (chdb) store")
    return Path(store_url[len("chdb://") :])


def test_reader_serves_read_only_sql_over_http(chdb_path, ch_client, ch_database):
    db = ch_database
    ch_client.command(f"CREATE DATABASE {db}")
    ch_client.command(
        f"CREATE TABLE {db}.t (run_id String, step UInt64, loss Float64) "
        "ENGINE = MergeTree ORDER BY step"
    )
    ch_client.insert(
        f"{db}.t", [["r", 0, 2.5], ["r", 1, math.nan]], column_names=["run_id", "step", "loss"]
    )
    server = ReadServer(chdb_path)
    try:
        url = server.start()
        assert find_reader(chdb_path) == url
        http = clickhouse_connect.get_client(host="127.0.0.1", port=server.port)
        rows = http.query(
            f"SELECT step, loss FROM {db}.t WHERE run_id = {{r:String}} ORDER BY step",
            parameters={"r": "r"},
        ).result_rows
        assert rows[0] == (0, 2.5) and math.isnan(rows[1][1])
        ch_client.insert(f"{db}.t", [["r", 2, 1.5]], column_names=["run_id", "step", "loss"])
        assert http.query(f"SELECT count() FROM {db}.t").result_rows == [(3,)]  # live
        with pytest.raises(DatabaseError, match="164"):  # READONLY
            http.command(f"INSERT INTO {db}.t VALUES ('x', 9, 0)")
        with pytest.raises(DatabaseError, match="DROP|164"):
            http.command(f"DROP TABLE {db}.t")
        assert ch_client.query(f"SELECT count() FROM {db}.t").result_rows == [(3,)]
        body = urllib.request.urlopen(f"{url}/?query=SELECT+max(step)+FROM+{db}.t").read()
        assert body == b"2\n"
        assert urllib.request.urlopen(f"{url}/ping").read() == b"Ok.\n"
    finally:
        server.close()
    assert not (chdb_path / READER_FILE).exists()


HOLDER = textwrap.dedent("""
    import sys, time
    from probewire.sinks.clickhouse import ClickHouseSink, connect
    from probewire.sinks.readserver import ReadServer
    path = sys.argv[1]
    sink = ClickHouseSink(connect("chdb:///" + path.lstrip("/")), "probewire")
    sink.migrate()
    sink.client.insert("probewire.runs", [["held", 2, "running"]],
                       column_names=["run_id", "world_size", "status"])
    if sys.argv[2] == "reader":
        ReadServer(path).start()
    print("ready", flush=True)
    time.sleep(120)
""")


def _hold(store: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(store), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def _sql(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "probewire.deploy.cli", "sql", "--store", str(store), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sql_reads_a_store_another_process_owns_through_its_reader(scratch_dir: Path):
    holder = _hold(scratch_dir / "store", "reader")
    try:
        out = _sql(
            scratch_dir / "store",
            "--format",
            "csv",
            "SELECT run_id, world_size FROM probewire.runs FINAL",
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == ["run_id,world_size", "held,2"]
    finally:
        holder.kill()
        holder.wait(10)


def test_sql_without_a_reader_names_the_process_holding_the_store(scratch_dir: Path):
    holder = _hold(scratch_dir / "store", "plain")
    try:
        out = _sql(scratch_dir / "store", "SELECT 1")
        assert out.returncode == 2 and out.stdout == ""
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
        assert f"held by pid {holder.pid} " in out.stderr
    finally:
        holder.kill()
        holder.wait(10)
