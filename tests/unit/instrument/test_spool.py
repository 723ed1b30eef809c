"""The offline spool: records come back as written, the file stays within its bound (what
does not fit is counted and said), a killed rank's cut record is skipped, and the mode is
one of three."""

from __future__ import annotations

import logging

import pytest

from probewire.instrument.lifecycle import resolve_mode
from probewire.instrument.spool import SpoolError, SpoolFile, SpoolTransport, read_spool


def test_records_come_back_in_order_with_their_kind(tmp_path):
    spool = SpoolFile(tmp_path / "r.spool", 1 << 20)
    metrics, runs = SpoolTransport(spool, "metrics"), SpoolTransport(spool, "runs")
    assert runs.send(b"run", b'{"event": "started"}')
    assert metrics.send(b"run:0", b"\x00otlp\xff")
    runs.close()  # flushes; the metrics transport closes the file
    metrics.close()
    assert list(read_spool(tmp_path / "r.spool")) == [
        ("runs", b"run", b'{"event": "started"}'),
        ("metrics", b"run:0", b"\x00otlp\xff"),
    ]


def test_the_file_stays_within_its_bound_and_counts_what_it_dropped(tmp_path, caplog):
    spool = SpoolFile(tmp_path / "r.spool", 100)
    t = SpoolTransport(spool, "metrics")
    with caplog.at_level(logging.WARNING):
        sent = [t.send(b"k", b"x" * 30) for _ in range(5)]
        t.close()
    assert sent == [True, True, False, False, False] and spool.dropped == 3
    assert (tmp_path / "r.spool").stat().st_size <= 100
    assert [r.getMessage() for r in caplog.records][-1] == (
        "probewire: 3 message(s) not spooled (spool full)"
    )


def test_a_record_cut_short_by_a_killed_rank_is_skipped_and_garbage_is_refused(tmp_path):
    spool = SpoolFile(tmp_path / "r.spool", 1 << 20)
    SpoolTransport(spool, "metrics").send(b"run:0", b"abc")
    spool.close()
    path = tmp_path / "r.spool"
    path.write_bytes(path.read_bytes() * 2 + b"\x00\x00\x00")  # a second record, then a cut
    assert len(list(read_spool(path))) == 2
    (tmp_path / "bad.spool").write_bytes(b"\x09" + b"\x00" * 8)
    with pytest.raises(SpoolError, match="not a probewire spool file"):
        list(read_spool(tmp_path / "bad.spool"))


def test_the_mode_comes_from_the_argument_else_the_environment():
    assert resolve_mode(None, {}) == "online"
    assert resolve_mode(None, {"PROBEWIRE_MODE": "Offline"}) == "offline"
    assert resolve_mode("disabled", {"PROBEWIRE_MODE": "offline"}) == "disabled"
    with pytest.raises(ValueError, match="one of online, offline, disabled"):
        resolve_mode(None, {"PROBEWIRE_MODE": "off"})
