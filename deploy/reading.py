"""How the CLI reads a store, and how it prints what it read.

``open_client`` finds the way in by itself: a ClickHouse server by its URL; for an
embedded (chdb) store, the live reader of the worker that owns it (``sinks.readserver``)
when one serves it, else a reader of this process's own over the directory (unpublished,
on loopback, closed at exit): either way the store is read under the reader's rules
(the engine's ``readonly = 1`` and its parse-tree allowlist), so a read command never
writes. When another process holds the directory and serves no reader, the error is one
line naming that process.

``render_rows`` prints rows as ``csv``, ``tsv`` or strict ``json`` (NaN and ±Inf become
null, dates become ISO text): pure functions, no I/O besides the returned text.
"""

from __future__ import annotations

import atexit
import contextlib
import csv
import datetime as dt
import io
import json
import logging
import math
import os
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["StoreError", "chdb_path", "json_value", "open_client", "render_rows"]


class StoreError(Exception):
    """The store cannot be read; the message is one line that says what to do."""


def chdb_path(url: str) -> Path | None:
    """The directory of a ``chdb:///abs/path`` URL, None for a server URL."""
    return Path(url[len("chdb://") :]) if url.startswith("chdb:///") else None


def open_client(
    url: str, *, username: str = "default", password_env: str = "", hint: str = "pass --store DIR"
) -> Any:
    """A clickhouse-connect client for reading the store at ``url`` (see the module doc)."""
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from probewire.deploy.settings import split_credentials
    from probewire.sinks.clickhouse import connect
    from probewire.sinks.readserver import reader_info, store_owner

    path = chdb_path(url)
    if path is None:
        shown = split_credentials(url)[0]  # a password written into the URL is never shown
        try:
            return connect(url, username=username, password_env=password_env)
        except ClickHouseError as exc:
            raise StoreError(f"cannot reach ClickHouse at {shown}: {_first_line(exc)}") from None
        except OSError as exc:
            raise StoreError(f"cannot reach ClickHouse at {shown}: {exc}") from None
    if not path.is_dir():
        raise StoreError(f"no store at {path}; {hint}")
    info = reader_info(path)
    if info is not None:
        reader = info["url"]
        logging.getLogger("clickhouse_connect").setLevel(logging.CRITICAL)  # one line, ours
        try:
            return _reader_client(reader, info["token"])
        except (ClickHouseError, OSError) as exc:
            raise StoreError(
                f"the live reader of {path} at {reader} did not answer "
                f"({_first_line(exc)[:120]}); its worker may be stopping, "
                "try again"
            ) from None
    owner = store_owner(path)
    if owner is None or owner.startswith(f"pid {os.getpid()} "):
        try:
            with _quiet_stderr():  # the engine prints its own lock error to fd 2
                return _reader_client(*_own_reader(path))
        except RuntimeError:
            owner = store_owner(path)  # taken meanwhile (a worker starting)
            if owner is None:
                raise
    raise StoreError(
        f"the store {path} is held by {owner}, which serves no live reads "
        "(yet); query it once that process ends, or through its worker's "
        "reader (`probewire up` / `run` start one)"
    )


def _own_reader(path: Path) -> tuple[str, str]:
    """``(url, token)`` of a read server of this process over the idle store at ``path``
    (a token of its own: other local users cannot read through it meanwhile)."""
    from probewire.sinks.readserver import ReadServer

    server = ReadServer(path, token=secrets.token_urlsafe(24))
    atexit.register(server.close)
    return server.start(publish=False), server.token


def _reader_client(url: str, token: str) -> Any:
    """A clickhouse-connect client of a reader, with its token as the password."""
    import clickhouse_connect

    return clickhouse_connect.get_client(dsn=url, username="default", password=token)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the block (output of native code included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def json_value(value: Any) -> Any:
    """A value as strict JSON allows it: NaN/±Inf → None, dates → ISO text, containers
    element by element, everything else unknown → str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (dt.datetime, dt.date)):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if hasattr(value, "item"):  # NumPy scalars
        return json_value(value.item())
    return str(value)


def render_rows(columns: Sequence[str], rows: Sequence[Sequence[Any]], fmt: str) -> str:
    """``json`` (a list of objects, strict), ``csv`` or ``tsv`` (a header line, then rows)."""
    if fmt == "json":
        return json.dumps(
            [{c: json_value(v) for c, v in zip(columns, row)} for row in rows], allow_nan=False
        )
    if fmt not in ("csv", "tsv"):
        raise ValueError(f"unknown format {fmt!r}")
    out = io.StringIO()
    writer = csv.writer(out, delimiter="," if fmt == "csv" else "\t", lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if v is None else _text(v) for v in row])
    return out.getvalue().rstrip("\n")


def _text(value: Any) -> str:
    value = json_value(value)
    if value is None:
        return "nan"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)
