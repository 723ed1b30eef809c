"""Fault injection for the worker's scenario tests (off unless its variables are set).

``PROBEWIRE_FAULT_STORE_OUTAGE=/path``: while that file exists every store call fails as
an outage would (``OSError``: retried by the sink, then ``StoreUnavailable``).
``PROBEWIRE_FAULT_CRASH_AGENT=name``: the named agent raises on its next event (the
health check must then fail naming it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

__all__ = ["crash_hook", "with_outage"]


class _OutageClient:
    """A clickhouse-connect client that fails while the outage file exists."""

    def __init__(self, client: Any, flag: Path) -> None:
        self._client, self._flag = client, flag

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name not in ("insert", "command", "query") or not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._flag.exists():
                raise OSError(f"store outage (fault file {self._flag} present)")
            return attr(*args, **kwargs)
        return call


def with_outage(client: Any, env: dict[str, str] | None = None) -> Any:
    flag = (env or os.environ).get("PROBEWIRE_FAULT_STORE_OUTAGE")
    return _OutageClient(client, Path(flag)) if flag else client


def crash_hook(env: dict[str, str] | None = None) -> Callable[[str], None]:
    target = (env or os.environ).get("PROBEWIRE_FAULT_CRASH_AGENT", "")

    def before_event(agent: str) -> None:
        if agent == target:
            raise RuntimeError(f"injected crash (PROBEWIRE_FAULT_CRASH_AGENT={target})")
    return before_event
