"""One line a minute from the rank's Kafka clients: the rest is held back and counted."""

from __future__ import annotations

import logging

from probewire.instrument.kafkalog import EveryMinute


def test_one_record_a_minute_passes_and_the_next_says_how_many_were_held():
    now = [0.0]
    gate = EveryMinute(60.0, clock=lambda: now[0])
    record = lambda: logging.LogRecord("k", logging.ERROR, "", 0, "FAIL %s", ("x",), None)  # noqa: E731
    passed = []
    for t in range(0, 130, 1):  # a retry every second for 130 s
        now[0] = float(t)
        r = record()
        if gate.filter(r):
            passed.append((t, r.getMessage()))
    assert passed == [
        (0, "FAIL x"),
        (60, "FAIL x (and 59 more such line(s) not shown)"),
        (120, "FAIL x (and 59 more such line(s) not shown)"),
    ]
