"""Live reads of an embedded store while another process owns it: the owner's read-only
ClickHouse HTTP endpoint (``sinks.readserver``) answers clickhouse-connect and curl-style
requests; ``probewire sql`` finds it by itself, and without it says in one line which
process holds the store."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
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
    if sys.argv[2] == "token":
        ReadServer(path, token="s3cret-token").start()
    print("ready", flush=True)
    if sys.argv[2] == "idle":
        sys.exit(0)
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


WRITES = (
    "DROP TABLE probewire.runs",
    "INSERT INTO probewire.runs (run_id, world_size, status) VALUES ('x', 1, 'running')",
    "ALTER TABLE probewire.runs DELETE WHERE 1",
    "SET readonly = 0",
)


def _refused_and_table_kept(store: Path) -> None:
    for sql in WRITES:
        out = _sql(store, sql)
        assert out.returncode == 2 and out.stdout == "", (sql, out.stdout, out.stderr)
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
        assert "READONLY" in out.stderr, out.stderr
    out = _sql(store, "--format", "csv", "SELECT run_id, status FROM probewire.runs FINAL")
    assert out.returncode == 0 and out.stdout.splitlines() == ["run_id,status", "held,running"]


def test_sql_never_writes_an_idle_store(scratch_dir: Path):
    """On a store no process holds, DROP, INSERT, ALTER and SET readonly = 0 through
    `probewire sql` each fail with one line (exit 2) and the table and its row are kept."""
    holder = _hold(scratch_dir / "store", "idle")
    assert holder.wait(60) == 0
    _refused_and_table_kept(scratch_dir / "store")


def test_sql_never_writes_a_served_store(scratch_dir: Path):
    """The same through the live reader of the process that owns the store."""
    holder = _hold(scratch_dir / "store", "reader")
    try:
        _refused_and_table_kept(scratch_dir / "store")
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


@pytest.fixture(scope="module")
def hostile_reader(store_url: str, ch_client, tmp_path_factory):
    """A reader over the session store with a table of its own, and a folder to watch."""
    if not store_url.startswith("chdb:///"):
        pytest.skip("the live reader serves an embedded (chdb) store")
    db = "pw_hostile"
    ch_client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
    ch_client.command(
        f"CREATE TABLE IF NOT EXISTS {db}.t (run_id String, step UInt64) "
        "ENGINE = MergeTree ORDER BY step"
    )
    ch_client.insert(f"{db}.t", [["r", 1], ["r", 2]], column_names=["run_id", "step"])
    server = ReadServer(Path(store_url[len("chdb://") :]))
    server.start(publish=False)
    try:
        yield server, db, tmp_path_factory.mktemp("hostile")
    finally:
        server.close()
        ch_client.command(f"DROP DATABASE IF EXISTS {db}")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


HOSTILE = {
    "host-file": "SELECT * FROM file('/etc/passwd', 'LineAsString')",
    "relative-glob": "SELECT * FROM file('../../../etc/*', 'LineAsString')",
    "environ": "SELECT * FROM file('/proc/self/environ', 'RawBLOB')",
    "environ-scalar": "SELECT file('/proc/self/environ')",
    "url-loopback": "SELECT * FROM url('http://127.0.0.1:{port}/?query=SELECT+1', 'CSV')",
    "insert-function": "INSERT INTO FUNCTION file('{dir}/written.csv', 'CSV') SELECT 1",
    "outfile": "SELECT 1 INTO OUTFILE '{dir}/outfile.txt'",
    "outfile-union": "SELECT 1 UNION ALL SELECT 2 INTO OUTFILE '{dir}/union.txt'",
    "two-statements": "SELECT 1; SELECT 2 INTO OUTFILE '{dir}/second.txt'",
    "remote": "SELECT * FROM remote('127.0.0.1:{port}', system.one)",
    "s3": "SELECT * FROM s3('http://127.0.0.1:{port}/bucket/x.csv', 'CSV')",
    "executable": "SELECT * FROM executable('cat', 'LineAsString', 'x String')",
    "dictionary": "SELECT * FROM dictionary('d')",
    "kill": "KILL QUERY WHERE 1",
    "system": "SYSTEM FLUSH LOGS",
    "set-readonly": "SET readonly = 0",
    "drop": "DROP TABLE {db}.t",
    "introspection": "SELECT addressToLine(toUInt64(1))",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_reader_refuses_what_reaches_the_host_or_writes(hostile_reader, name: str):
    """Each query that reads a host file, reaches the network, writes a file, kills or
    administers is refused with one line (an engine error, status 500), no file is left
    behind, and the store's table still answers."""
    server, db, folder = hostile_reader
    sql = HOSTILE[name].format(port=server.port, dir=folder, db=db)
    status, body = _get(f"{server.url}/?query={urllib.parse.quote(sql)}")
    assert status == 500 and body.startswith("Code: ") and body.count("\n") == 1, body
    assert "root:" not in body and "PATH=" not in body
    assert list(folder.iterdir()) == []
    assert _get(f"{server.url}/?query=" + urllib.parse.quote(f"SELECT count() FROM {db}.t")) == (
        200,
        "2\n",
    )


def test_reader_answers_selects_formats_and_parameters(hostile_reader):
    """Ordinary reads still work: parameters through clickhouse-connect, FORMAT clauses,
    an arithmetic table function; settings given as URL parameters apply to their request
    only (a max_result_rows given once does not stay set for the next client)."""
    server, db, _ = hostile_reader
    http = clickhouse_connect.get_client(host="127.0.0.1", port=server.port)
    rows = http.query(
        f"SELECT step FROM {db}.t WHERE run_id = {{r:String}} ORDER BY step",
        parameters={"r": "r"},
    ).result_rows
    assert rows == [(1,), (2,)]
    sql = f"SELECT step FROM {db}.t ORDER BY step FORMAT JSONEachRow"
    assert _get(f"{server.url}/?query={urllib.parse.quote(sql)}") == (
        200,
        '{"step":1}\n{"step":2}\n',
    )
    probe = urllib.parse.quote("SELECT getSetting('max_result_rows')")
    assert _get(f"{server.url}/?max_result_rows=5&query={probe}") == (200, "5\n")
    assert _get(f"{server.url}/?query={probe}") == (200, "0\n")
    assert http.query("SELECT name FROM numbers(1) ARRAY JOIN ['a'] AS name").result_rows == [
        ("a",)
    ]


def test_a_reader_with_a_token_refuses_requests_without_it(chdb_path):
    """With a token, a request without it or with a wrong one is refused with one line
    (status 403, code 516); the token as clickhouse-connect's password, as X-ClickHouse-Key
    or as the password parameter is answered; /ping stays open. The discovery file holding
    it is mode 0600."""
    server = ReadServer(chdb_path, token="t0ken")
    try:
        url = server.start()
        assert (chdb_path / READER_FILE).stat().st_mode & 0o777 == 0o600
        assert json.loads((chdb_path / READER_FILE).read_text())["token"] == "t0ken"
        query = urllib.parse.quote("SELECT 1")
        for suffix in ("", "&password=wrong"):
            status, body = _get(f"{url}/?query={query}{suffix}")
            assert status == 403 and "516" in body and body.count("\n") == 1, body
        with pytest.raises(DatabaseError, match="516"):
            clickhouse_connect.get_client(host="127.0.0.1", port=server.port).query("SELECT 1")
        http = clickhouse_connect.get_client(host="127.0.0.1", port=server.port, password="t0ken")
        assert http.query("SELECT 2").result_rows == [(2,)]
        assert _get(f"{url}/?query={query}&password=t0ken") == (200, "1\n")
        request = urllib.request.Request(
            f"{url}/?query={query}", headers={"X-ClickHouse-Key": "t0ken"}
        )
        assert urllib.request.urlopen(request, timeout=30).read() == b"1\n"
        assert _get(f"{url}/ping") == (200, "Ok.\n")
    finally:
        server.close()


def test_sql_finds_and_uses_the_token_of_a_served_store(scratch_dir: Path):
    """`probewire sql --store` reads the token from the discovery file and is answered."""
    holder = _hold(scratch_dir / "store", "token")
    try:
        out = _sql(
            scratch_dir / "store", "--format", "csv", "SELECT run_id FROM probewire.runs FINAL"
        )
        assert out.returncode == 0 and out.stdout.splitlines() == ["run_id", "held"], out.stderr
    finally:
        holder.kill()
        holder.wait(10)


def test_a_forged_discovery_file_is_not_trusted(scratch_dir: Path):
    """A discovery file whose PID is not the process holding the store (pid 1, pointing at
    a port that never answers) is ignored: `probewire sql` says at once which process holds
    the store instead of hanging on the forged address."""
    holder = _hold(scratch_dir / "store", "plain")
    try:
        forged = {"url": "http://127.0.0.1:9/", "pid": 1, "store": str(scratch_dir / "store")}
        (scratch_dir / "store" / READER_FILE).write_text(json.dumps(forged))
        assert find_reader(scratch_dir / "store") is None
        started = time.monotonic()
        out = _sql(scratch_dir / "store", "SELECT 1")
        assert time.monotonic() - started < 30
        assert out.returncode == 2 and f"held by pid {holder.pid} " in out.stderr, out.stderr
    finally:
        holder.kill()
        holder.wait(10)


WRITER = textwrap.dedent("""
    import sys
    from probewire.sinks.clickhouse import ClickHouseSink, connect
    sink = ClickHouseSink(connect("chdb:///" + sys.argv[1].lstrip("/")), "probewire")
    sink.migrate()
    sink.write("step_metrics", [
        {"run_id": sys.argv[2], "step": s, "loss": 2.0 + s, "grad_norm": 1.0, "step_time_s": 0.1}
        for s in range(3)
    ])
""")


@pytest.mark.parametrize("run_id", ["$(touch PWNED)", 'it\'s "q" `touch PWNED2` !x'])
def test_the_printed_sql_line_runs_the_intended_query_in_bash(scratch_dir: Path, run_id: str):
    """The "next" sql line printed for a hostile run id, run by bash with the real CLI,
    creates no file and answers that run's three steps from the store."""
    import shlex

    from probewire.deploy.result import RunResult, render_result

    store = scratch_dir / "store"
    subprocess.run([sys.executable, "-c", WRITER, str(store), run_id], check=True, timeout=120)
    text = render_result(
        RunResult(run_id, "finished", 3, 2, ()), f"--store {shlex.quote(str(store))}"
    )
    (line,) = [x for x in text.splitlines() if x.strip().startswith("probewire sql")]
    cli = f'probewire() {{ {shlex.quote(sys.executable)} -m probewire.deploy.cli "$@"; }}'
    work = scratch_dir / "cwd"
    work.mkdir()
    out = subprocess.run(
        ["bash", "-c", f"{cli}\n{line}"], cwd=work, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert list(work.iterdir()) == [] and sorted(p.name for p in scratch_dir.iterdir()) == [
        "cwd",
        "store",
    ]
    rows = [r for r in out.stdout.splitlines() if r.strip("│ ").split(" ")[0] in {"0", "1", "2"}]
    assert len(rows) == 3, out.stdout
