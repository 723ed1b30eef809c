"""A rank whose broker is down, or whose bootstrap port is not Kafka, on real librdkafka
clients and real sockets (``tests/e2e/job_script.py`` as the rank): one line at attach,
librdkafka's retries at most one line a minute, and ``close()`` back within its bound
(``ProbeConfig.close_timeout_s``, 5 s) saying how many messages were not delivered."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCRIPT = Path(__file__).resolve().parents[1] / "e2e" / "job_script.py"


def rank(bootstrap: str, steps: int) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PROBEWIRE_")}
    env = {**clean, "OMP_NUM_THREADS": "1", "PROBEWIRE_RUN_ID": "down1"}
    env["PROBEWIRE_KAFKA__BOOTSTRAP"] = bootstrap
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", str(steps), "--sleep-s", "0.2"],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
    )


def seconds(out: subprocess.CompletedProcess, what: str) -> float:
    return float(re.search(rf"{what} in ([0-9.]+) s", out.stdout).group(1))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_down_broker_is_one_line_a_minute_and_close_is_bounded() -> None:
    """20 steps against a closed port (librdkafka logged 616 lines and close waited 60 s)."""
    out = rank(f"127.0.0.1:{closed_port()}", 20)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    assert sum("no Kafka broker answers at" in line for line in lines) == 1, lines
    retries = [line for line in lines if "rdkafka" in line or "delivery failed" in line]
    assert len(retries) <= 1, retries  # the run lasts well under a minute
    assert seconds(out, "closed") <= 5.0 + 1.0 + 1.0  # close_timeout_s, two event flushes
    assert any("20 message(s) to otlp_metrics not delivered" in line for line in lines), lines


def test_a_port_that_is_not_kafka_is_said_once_at_attach() -> None:
    """A listener that takes connections and never answers: attach says so once, within
    its 2 s probe (a TCP connect alone passed it)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    threading.Thread(
        target=lambda: [held.append(server.accept()[0]) for _ in range(64)], daemon=True
    ).start()
    try:
        out = rank(f"127.0.0.1:{server.getsockname()[1]}", 3)
    finally:
        server.close()
    assert out.returncode == 0, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if "no Kafka broker answers at" in line]
    assert len(said) == 1 and "not a Kafka answer within 2s" in said[0], out.stderr
    assert seconds(out, "attached") <= 2.0 + 2.0, out.stdout
