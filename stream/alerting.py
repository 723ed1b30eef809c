"""Optional alert webhook in Alertmanager's JSON format (POST a list to /api/v2/alerts).

A failing webhook is logged and counted; it never stops the stream. The log names the
webhook by scheme, host and port only: a webhook URL often carries its secret (user
info, a token in the path or the query).
"""

from __future__ import annotations

import http.client
import json
import logging
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

__all__ = ["AlertmanagerWebhook", "to_alertmanager"]

log = logging.getLogger(__name__)


def to_alertmanager(alert: dict[str, Any]) -> dict[str, Any]:
    """One probewire alert row as an Alertmanager alert (labels identify, annotations explain)."""
    return {
        "labels": {
            "alertname": f"probewire_{alert['signal']}",
            "run_id": alert["run_id"],
            "signal": alert["signal"],
            "severity": alert["severity"],
        },
        "annotations": {
            "summary": alert["message"],
            "description": "open next: " + " -> ".join(alert["next_steps"]),
            "step": str(alert["step"]),
            "tokens": str(alert["tokens"]),
            "ranks": ",".join(map(str, alert["ranks"])),
        },
        "startsAt": datetime.now(UTC).isoformat(),
    }


def where(url: str) -> str:
    """``scheme://host[:port]`` of a URL: what a log may say about it."""
    parts = urlsplit(url)
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"{parts.scheme}://{parts.hostname or '?'}{port}"


@dataclass(slots=True)
class AlertmanagerWebhook:
    url: str
    timeout_s: float = 5.0
    sent: int = 0
    failed: int = 0

    def post(self, alerts: Sequence[dict[str, Any]]) -> bool:
        """POST the alerts; returns False (and counts) on failure. No URL: nothing to do."""
        if not self.url or not alerts:
            return True
        body = json.dumps([to_alertmanager(a) for a in alerts]).encode()
        request = urllib.request.Request(
            self.url, data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                ok = 200 <= response.status < 300
        except (urllib.error.URLError, OSError) as exc:
            log.warning(
                "probewire: alert webhook %s failed: %s",
                where(self.url),
                getattr(exc, "reason", exc),
            )
            ok = False
        except (ValueError, http.client.InvalidURL):  # its text may hold the secret: not logged
            log.warning("probewire: alert webhook %s failed: not a valid URL", where(self.url))
            ok = False
        self.sent += ok
        self.failed += not ok
        return ok
