"""Fault injection for the worker's scenario tests (off unless its variables are set).

``PROBEWIRE_FAULT_STORE_OUTAGE=/path``: while that file exists every store call fails as
an outage would (``OSError``: retried by the sink, then ``StoreUnavailable``).
``PROBEWIRE_FAULT_CRASH_AGENT=name``: the named agent raises on its next event (the
health check must then fail naming it).
``PROBEWIRE_FAULT_SKIP_RANK_MESSAGES=3,6,7``: the 3rd, 6th and 7th rank message of each
partition never reach stage 1, as when the consumer moved past them (``stream.gaps``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["fault_hook", "with_outage"]


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


def with_outage(client: Any, env: Mapping[str, str] | None = None) -> Any:
    flag = (env or os.environ).get("PROBEWIRE_FAULT_STORE_OUTAGE")
    return _OutageClient(client, Path(flag)) if flag else client


def fault_hook(env: Mapping[str, str] | None = None) -> Callable[..., bool]:
    """The worker's ``before_event(agent, partition)``: raises for the agent to crash;
    True for a rank message to drop."""
    env = env or os.environ
    target = env.get("PROBEWIRE_FAULT_CRASH_AGENT", "")
    skip = {int(n) for n in env.get("PROBEWIRE_FAULT_SKIP_RANK_MESSAGES", "").split(",") if n}
    seen: dict[int, int] = {}

    def before_event(agent: str, partition: int | None = None) -> bool:
        if agent == target:
            raise RuntimeError(f"injected crash (PROBEWIRE_FAULT_CRASH_AGENT={target})")
        if agent != "assemble" or not skip or partition is None:
            return False
        seen[partition] = seen.get(partition, 0) + 1
        return seen[partition] in skip

    return before_event
