"""Offline mode: a rank's messages to a local spool file, replayed later by ``probewire sync``.

With ``PROBEWIRE_MODE=offline`` (or ``attach(mode="offline")``) a rank needs no broker: its
OTLP step messages, its lifecycle events and its checkpoint announcements are appended,
exactly as they would have been published, to one file per process in the spool folder
(``PROBEWIRE_SPOOL_DIR``, default ``./probewire-spool``)::

    <run_id>.rank<rank>.<pid>.spool    records of: kind (1 byte), key length and value
                                       length (4 bytes each, big-endian), key, value

``kind`` names the topic (``metrics``, ``runs``, ``checkpoints``, ``detail``); ``probewire sync DIR``
publishes each record to that topic of a stack, whose worker stores them as if live. The
file is bounded (``PROBEWIRE_SPOOL_MAX_BYTES``, default 1 GiB): a record that would pass the
bound is dropped, counted, and said once at the time and once at close.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

__all__ = ["KINDS", "SPOOL_DIR_ENV", "SpoolFile", "SpoolTransport", "read_spool", "spool_file"]

log = logging.getLogger(__name__)

SPOOL_DIR_ENV = "PROBEWIRE_SPOOL_DIR"
SPOOL_MAX_ENV = "PROBEWIRE_SPOOL_MAX_BYTES"
DEFAULT_MAX_BYTES = 1 << 30
KINDS = ("metrics", "runs", "checkpoints", "detail")  # codes are stored: append only
_HEADER = struct.Struct(">BII")


class SpoolError(ValueError):
    """A spool file that is not one (a one-line reason)."""


class SpoolFile:
    """One process's spool file, shared by its transports (one lock; appends only)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        if max_bytes < _HEADER.size:
            raise ValueError(f"{SPOOL_MAX_ENV} must be >= {_HEADER.size}, got {max_bytes}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.max_bytes = path, max_bytes
        self._file = open(path, "ab")
        self._size = self._file.tell()
        self._lock = threading.Lock()
        self.dropped = 0

    def append(self, kind: str, key: bytes, value: bytes) -> bool:
        record = _HEADER.pack(KINDS.index(kind), len(key), len(value)) + key + value
        with self._lock:
            if self._size + len(record) > self.max_bytes:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning(
                        "probewire: spool %s is full (%s=%d bytes): further messages are "
                        "dropped and counted",
                        self.path,
                        SPOOL_MAX_ENV,
                        self.max_bytes,
                    )
                return False
            self._file.write(record)
            self._size += len(record)
            return True

    def flush(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.close()
        if self.dropped:
            log.warning("probewire: %d message(s) not spooled (spool full)", self.dropped)


class SpoolTransport:
    """A ``Transport`` that appends to a spool file under one kind (topic)."""

    def __init__(self, spool: SpoolFile, kind: str) -> None:
        self._spool, self._kind = spool, kind

    def send(self, key: bytes, value: bytes) -> bool:
        return self._spool.append(self._kind, key, value)

    def flush(self, timeout_s: float) -> int:
        self._spool.flush()
        return 0

    def close(self) -> None:
        if self._kind == "metrics":  # the metrics transport closes last (Monitor.close)
            self._spool.close()
        else:
            self._spool.flush()


def spool_file(run_id: str, rank: int, env: Mapping[str, str]) -> SpoolFile:
    """This process's spool file, from ``PROBEWIRE_SPOOL_DIR`` / ``PROBEWIRE_SPOOL_MAX_BYTES``."""
    folder = Path(env.get(SPOOL_DIR_ENV) or "probewire-spool")
    text = env.get(SPOOL_MAX_ENV) or str(DEFAULT_MAX_BYTES)
    if not text.isdigit():
        raise ValueError(f"{SPOOL_MAX_ENV} must be a number of bytes, got {text!r}")
    return SpoolFile(folder / f"{run_id}.rank{rank}.{os.getpid()}.spool", int(text))


def read_spool(path: Path) -> Iterator[tuple[str, bytes, bytes]]:
    """The records of one spool file as (kind, key, value), in the order written; a
    ``SpoolError`` naming the file and offset for bytes that are not a record (a record
    cut short by a killed rank ends the file: it is skipped with a warning)."""
    data = path.read_bytes()
    at = 0
    while at < len(data):
        if len(data) - at < _HEADER.size:
            log.warning("probewire: %s ends in a partial record at byte %d; skipped", path, at)
            return
        code, key_len, value_len = _HEADER.unpack_from(data, at)
        if code >= len(KINDS):
            raise SpoolError(f"{path} is not a probewire spool file (byte {at})")
        end = at + _HEADER.size + key_len + value_len
        if end > len(data):
            log.warning("probewire: %s ends in a partial record at byte %d; skipped", path, at)
            return
        key = data[at + _HEADER.size : at + _HEADER.size + key_len]
        yield KINDS[code], key, data[end - value_len : end]
        at = end
