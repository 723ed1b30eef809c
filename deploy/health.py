"""Heartbeat files: liveness for Kubernetes exec probes and progress for the local demo.

A service rewrites its heartbeat atomically every few seconds and after each durable
write; ``probewire health --component NAME`` exits 0 when the file is fresh.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Heartbeat", "default_heartbeat_path", "read_heartbeat"]


def default_heartbeat_path(component: str) -> Path:
    base = os.environ.get("PROBEWIRE_HEARTBEAT_DIR", os.path.join(tempfile.gettempdir(),
                                                                  "probewire"))
    return Path(base) / f"{component}.heartbeat"


@dataclass(slots=True)
class Heartbeat:
    """Writes ``{"component", "ts", "status", "runs": {run_id: {...}}}`` atomically."""

    path: Path
    component: str
    status: str = "starting"
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def beat(self, status: str | None = None) -> None:
        if status is not None:
            self.status = status
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = {"component": self.component, "ts": time.time(), "status": self.status,
                "pid": os.getpid(), "runs": self.runs}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        os.replace(tmp, self.path)


def read_heartbeat(path: Path) -> dict[str, Any] | None:
    """The last heartbeat, or None when there is none (yet)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
