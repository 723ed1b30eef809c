"""Live reads of the embedded store: ClickHouse's HTTP interface, read-only, on loopback.

chdb lets one process own a data directory, and while a run trains that process is the
stream worker. ``ReadServer`` runs inside it and answers SQL the way a ClickHouse server's
HTTP port does (``GET/POST /?query=...``, ``database``, ``default_format``, ``param_<name>``
for ``{name:Type}`` parameters, ``FORMAT`` clauses, errors as ``Code: N. DB::Exception``
with status 500 and ``X-ClickHouse-Exception-Code``), so clickhouse-connect, curl and
Grafana's ClickHouse data source (HTTP protocol) read the embedded store like a server.

Read-only is the engine's own rule, on a session of its own per request: each query runs
on a fresh connection whose URL settings are applied first (they last for that request
only), then ``allow_introspection_functions = 0`` and ``readonly = 1``: the engine refuses
INSERT, ALTER, DROP, CREATE, ``SET``, ``SETTINGS`` clauses and every table function that
reaches the host or the network (``file``, ``url``, ``s3``, ``hdfs``, ``remote``,
``executable``, ``dictionary``, ...). As a second line, ``sinks.sqlguard`` checks the
engine's own parse tree of the statement (multi-statements are a syntax error there):
SELECT / SHOW / DESCRIBE / EXISTS only (no KILL, no SYSTEM), no ``INTO OUTFILE``, no
scalar ``file()``. A refused query is a ``Code: 164 ... (READONLY)`` error. Queries
are served one at a time, beside the worker's writer connection. Responses are
uncompressed (``compress=1``, ClickHouse's own block compression, is refused with a clear
error). Tested with clickhouse-connect and plain HTTP; Grafana's data source is not tested
here.

Access: with a ``token`` (``probewire up`` / ``run`` / ``demo`` make one per worker and
pass it in ``PROBEWIRE_READER_TOKEN``), a request must carry it as the ClickHouse password
(HTTP basic auth, ``X-ClickHouse-Key`` or the ``password`` parameter; any user name), else
it is refused (``Code: 516 ... (AUTHENTICATION_FAILED)``, status 403); ``/ping`` stays
open. Discovery: on start the server writes ``<store>/probewire-reader.json`` —
``{"url", "pid", "store", "token"}``, created 0600 — and removes it on close, so ``probewire
sql --store DIR`` finds it by itself. ``reader_info`` trusts the file only when its PID is
the process that holds the store (the engine's own ``status`` file) and is alive, so a
forged file is ignored.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .sqlguard import refusal

__all__ = [
    "READER_FILE",
    "READER_TOKEN_ENV",
    "ReadServer",
    "find_reader",
    "owner_pid",
    "reader_info",
    "store_owner",
]

READER_FILE = "probewire-reader.json"
READER_TOKEN_ENV = "PROBEWIRE_READER_TOKEN"  # the worker's reader token, set by its launcher

# URL parameters of ClickHouse's HTTP interface that are not settings
_NOT_SETTINGS = frozenset(
    {
        "query",
        "database",
        "default_format",
        "query_id",
        "session_id",
        "session_timeout",
        "session_check",
        "compress",
        "decompress",
        "user",
        "password",
        "quota_key",
        "buffer_size",
        "wait_end_of_query",
        "enable_http_compression",
        "send_progress_in_http_headers",
        "http_headers_progress_interval_ms",
        "readonly",
    }
)
_MAX_BODY = 1 << 20
_DENIED = (
    b"Code: 516. DB::Exception: this probewire reader needs its token as the password "
    b"(`probewire sql --store DIR` reads it from the store's probewire-reader.json). "
    b"(AUTHENTICATION_FAILED)\n"
)
# applied last on every reading session: the engine's own read-only rules (see above)
_LOCKDOWN = ("SET allow_introspection_functions = 0", "SET readonly = 1")


class ReadServer:
    """Serves read-only SQL on ``host:port`` (0: a free port) for the chdb store at ``path``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
    ) -> None:
        import chdb

        self.path = Path(path).resolve()
        self.token = token
        # keeps the engine of this process open while requests open and close their own
        self._conn = chdb.connect(str(self.path))
        for statement in _LOCKDOWN:
            self._conn.query(statement)
        self._lock = threading.Lock()
        self.queries = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet: the worker's log is its own
                return None

            def do_GET(self) -> None:
                self._serve(b"")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length > _MAX_BODY:
                    self._reply(413, b"query body too large\n", {})
                    return
                self._serve(self.rfile.read(length) if length else b"")

            def _serve(self, body: bytes) -> None:
                url = urlsplit(self.path)
                if url.path in ("/ping", "/"):
                    params = {
                        k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()
                    }
                    if url.path == "/ping" or ("query" not in params and not body):
                        self._reply(200, b"Ok.\n", {})
                        return
                    if not server.admits(self.headers, params):
                        self._reply(403, _DENIED, {"X-ClickHouse-Exception-Code": "516"})
                        return
                    status, payload, headers = server.execute(params, body)
                    self._reply(status, payload, headers)
                    return
                self._reply(404, b"unknown path\n", {})

            def _reply(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for key, value in {
                    "Content-Type": "text/plain; charset=UTF-8",
                    **headers,
                    "Content-Length": str(len(payload)),
                }.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(payload)

        self._http = ThreadingHTTPServer((host, port), Handler)
        self._http.daemon_threads = True
        self.host, self.port = self._http.server_address[:2]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def admits(self, headers: Any, params: dict[str, str]) -> bool:
        """Whether a request carries the token (always, when the server has none)."""
        if not self.token:
            return True
        given = headers.get("X-ClickHouse-Key") or params.get("password") or ""
        auth = headers.get("Authorization") or ""
        if not given and auth.startswith("Basic "):
            try:
                given = base64.b64decode(auth[6:]).decode().partition(":")[2]
            except (ValueError, UnicodeDecodeError):
                given = ""
        return hmac.compare_digest(given.encode(), self.token.encode())

    def execute(self, params: dict[str, str], body: bytes) -> tuple[int, bytes, dict[str, str]]:
        """One request: ``(status, payload, headers)`` as a ClickHouse server answers it."""
        if params.get("compress") == "1":
            return (
                400,
                (
                    b"Code: 1001. DB::Exception: this endpoint answers uncompressed "
                    b"(compress=1 is not supported); turn compression off in the "
                    b"client\n"
                ),
                {"X-ClickHouse-Exception-Code": "1001"},
            )
        sql = " ".join(
            part
            for part in (params.get("query", ""), body.decode("utf-8", "replace"))
            if part.strip()
        )
        fmt = params.get("default_format") or "TabSeparated"
        binds = {k[len("param_") :]: v for k, v in params.items() if k.startswith("param_")}
        settings = {
            k: v for k, v in params.items() if k not in _NOT_SETTINGS and not k.startswith("param_")
        }
        try:
            with self._lock:
                refused, result, started = self._run(params, settings, sql, fmt, binds)
        except Exception as exc:  # the engine's error, passed on as a server would
            text = str(exc).strip()
            code = (
                text.split(".", 1)[0].removeprefix("Code: ") if text.startswith("Code:") else "1001"
            )
            return 500, (text + "\n").encode(), {"X-ClickHouse-Exception-Code": code}
        if refused is not None:
            return (
                500,
                f"Code: 164. DB::Exception: the read-only reader refuses {refused}. (READONLY)\n".encode(),
                {"X-ClickHouse-Exception-Code": "164"},
            )
        summary = {
            "read_rows": str(result.rows_read()),
            "read_bytes": str(result.bytes_read()),
            "elapsed_ns": str(int((time.perf_counter() - started) * 1e9)),
        }
        return (
            200,
            result.bytes(),
            {
                "X-ClickHouse-Format": fmt,
                "X-ClickHouse-Timezone": time.strftime("%Z") or "UTC",
                "X-ClickHouse-Summary": json.dumps(summary),
            },
        )

    def _run(
        self,
        params: dict[str, str],
        settings: dict[str, str],
        sql: str,
        fmt: str,
        binds: dict[str, str],
    ) -> tuple[str | None, Any, float]:
        """``(refusal, result, start time)`` of one query on a session of its own."""
        import chdb

        # the statement is checked on the server's own session (no client settings, so a
        # client's max_result_rows cannot break the check), then runs on a fresh one
        self._conn.query(f"USE {_identifier(params.get('database') or 'default')}")
        canonical = (
            self._conn.query(f"SELECT formatQuerySingleLine({_literal(sql)})", "TSVRaw")
            .bytes()
            .decode()
            .rstrip("\n")
        )
        ast = self._conn.query(f"EXPLAIN AST {canonical}", "TSVRaw", params=binds or None)
        refused = refusal(ast.bytes().decode())
        if refused is not None:
            return refused, None, 0.0
        conn = chdb.connect(str(self.path))
        try:
            conn.query(f"USE {_identifier(params.get('database') or 'default')}")
            for key, value in settings.items():
                conn.query(f"SET {_identifier(key)} = {_literal(value)}")
            for statement in _LOCKDOWN:
                conn.query(statement)
            started = time.perf_counter()
            result = conn.query(canonical, fmt, params=binds or None)
            self.queries += 1
            return None, result, started
        finally:
            conn.close()

    def start(self, *, publish: bool = True) -> str:
        """Serve on a background thread; with ``publish``, write the address into the
        store directory for other processes (see the module doc)."""
        self._thread = threading.Thread(
            target=self._http.serve_forever, name="probewire-reader", daemon=True
        )
        self._thread.start()
        if publish:
            info = {"url": self.url, "pid": os.getpid(), "store": str(self.path)}
            tmp = self.path / (READER_FILE + ".tmp")
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                json.dump({**info, "token": self.token}, out)
            os.replace(tmp, self.path / READER_FILE)
        return self.url

    def close(self) -> None:
        try:
            info = json.loads((self.path / READER_FILE).read_text())
            if info.get("pid") == os.getpid():
                (self.path / READER_FILE).unlink()
        except (OSError, ValueError):
            pass
        self._http.shutdown()
        self._http.server_close()
        with self._lock:  # an embedded connection left open can crash the process at exit
            self._conn.close()


def _identifier(name: str) -> str:
    if not name.replace("_", "").isalnum():
        raise ValueError(f"Code: 62. DB::Exception: bad identifier {name!r}. (SYNTAX_ERROR)")
    return name


def _literal(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reader_info(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``{"url", "pid", "store", "token"}`` of the live reader serving the store at
    ``path``, or None: the discovery file is trusted only when its PID is the live process
    that holds the store."""
    try:
        info = json.loads((Path(path) / READER_FILE).read_text())
        url, pid = str(info["url"]), int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid != _owner_pid(path) or not _alive(pid) or not url.startswith("http://127.0.0.1:"):
        return None
    return {**info, "url": url, "pid": pid, "token": str(info.get("token") or "")}


def find_reader(path: str | os.PathLike[str]) -> str | None:
    """The URL of the live reader serving the store at ``path``, or None."""
    info = reader_info(path)
    return None if info is None else info["url"]


def _owner_pid(path: str | os.PathLike[str]) -> int | None:
    """The PID the engine wrote into the store's ``status`` file (``PID: N``), or None
    (the PID of a process that has ended too: ``owner_pid`` is the live one)."""
    try:
        first = (Path(path) / "status").read_text().splitlines()[0]
        return int(first.removeprefix("PID:").strip())
    except (OSError, ValueError, IndexError):
        return None


def owner_pid(path: str | os.PathLike[str]) -> int | None:
    """The PID of the live process holding the chdb store at ``path``, or None."""
    pid = _owner_pid(path)
    return pid if pid is not None and _alive(pid) else None


def store_owner(path: str | os.PathLike[str]) -> str | None:
    """``pid N (command line)`` of the process holding the chdb store at ``path``, or None
    when no live process holds it (the engine writes ``PID: N`` into its ``status`` file)."""
    pid = owner_pid(path)
    if pid is None:
        return None
    try:
        cmd = " ".join(
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode(errors="replace")
            .split()
        )  # one line, whatever the argv
    except OSError:
        cmd = ""
    return f"pid {pid}" + (f" ({cmd[:120]})" if cmd else "")
