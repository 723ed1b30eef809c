"""``probewire sync``'s replay order: per run, started first, steps in step order (every
rank's message of a step together), the end events last."""

from __future__ import annotations

import json

import pytest

from probewire.deploy.session import SessionError
from probewire.deploy.sync import replay_order, spooled


def event(kind: str) -> bytes:
    return json.dumps({"event": kind}).encode()


def test_records_replay_started_first_then_steps_together_then_the_end():
    rank0 = [("runs", b"r", event("started"))] + [
        ("metrics", f"r:{s}".encode(), b"0") for s in (0, 1, 2)
    ]
    rank0.append(("runs", b"r", event("finished")))
    rank1 = [("metrics", f"r:{s}".encode(), b"1") for s in (0, 1, 2)]
    rank1.append(("runs", b"r", event("crashed")))
    got = [(k, key, v) for k, key, v in replay_order(rank0 + rank1)]
    assert got[0] == ("runs", b"r", event("started"))
    assert [(key, v) for k, key, v in got[1:7]] == [
        (b"r:0", b"0"),
        (b"r:0", b"1"),
        (b"r:1", b"0"),
        (b"r:1", b"1"),
        (b"r:2", b"0"),
        (b"r:2", b"1"),
    ]
    assert [v for _, _, v in got[7:]] == [event("finished"), event("crashed")]


def test_a_folder_without_spool_files_is_one_line(tmp_path):
    with pytest.raises(SessionError, match="no \\*.spool files in"):
        spooled(tmp_path)
    with pytest.raises(SessionError, match="no spool folder"):
        spooled(tmp_path / "missing")
