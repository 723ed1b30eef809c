"""In-memory fakes that ship with the library (for tests, benchmarks and notebooks)."""

from __future__ import annotations

import threading

__all__ = ["MemoryTransport", "NullTransport"]


class MemoryTransport:
    """Keeps every (key, value) it is sent, in order; thread-safe."""

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, bytes]] = []
        self._lock = threading.Lock()
        self.closed = False

    def send(self, key: bytes, value: bytes) -> bool:
        with self._lock:
            self.messages.append((key, value))
        return True

    def flush(self, timeout_s: float) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class NullTransport:
    """Drops every message and counts them and their bytes (benchmarks)."""

    def __init__(self) -> None:
        self.messages = 0
        self.bytes = 0

    def send(self, key: bytes, value: bytes) -> bool:
        self.messages += 1
        self.bytes += len(key) + len(value)
        return True

    def flush(self, timeout_s: float) -> int:
        return 0

    def close(self) -> None:
        return None
