"""Heartbeat files live with the shared plumbing (``probewire.instrument.plumbing``);
re-exported here for the CLI and the local stack."""

from probewire.instrument.plumbing import (
    Heartbeat,
    default_heartbeat_path,
    read_heartbeat,
    writer_alive,
)

__all__ = ["Heartbeat", "default_heartbeat_path", "read_heartbeat", "writer_alive"]
