"""Heartbeat files live with the stream (``probewire.stream.health``); re-exported here for
the CLI and the local stack."""

from probewire.stream.health import (
    Heartbeat,
    default_heartbeat_path,
    read_heartbeat,
    writer_alive,
)

__all__ = ["Heartbeat", "default_heartbeat_path", "read_heartbeat", "writer_alive"]
