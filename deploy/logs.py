"""Log output of every probewire service: plain text, or one JSON object per line.

``--log-format json`` (any command) writes each record as one line
``{"ts": ..., "level": ..., "logger": ..., "message": ..., "service": ...}`` plus
``exc_info`` when a traceback is attached, for log collectors that parse JSON.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

__all__ = ["FORMATS", "JsonFormatter", "logging_config"]

FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in the message are escaped)."""

    def __init__(self, service: str = "probewire") -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": self.service,
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def logging_config(fmt: str, level: str | int, service: str) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` dict: one stderr handler in ``fmt`` at ``level``
    (the Faust worker hands the same dict to mode, so its own records follow it)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    formatter = {"()": JsonFormatter, "service": service} if fmt == "json" else {"format": _TEXT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"probewire": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "probewire",
            }
        },
        "root": {
            "level": level.upper() if isinstance(level, str) else level,
            "handlers": ["stderr"],
        },
    }
