"""Health that tells the truth within seconds, on a real broker and worker: a SIGKILLed,
a SIGSTOPped and a broker-less worker each fail ``probewire health`` within its stated
bound (10 s by default), with one line that says which, and a healthy one passes; the
heartbeat counts the steps the store took, not those it was given; ``/metrics`` shows the
consumer lag per partition and the steps stored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack, free_port, stop_process
from probewire.instrument.catalog import Loss
from probewire.instrument.wire import Point, RankIdentity, WireEncoder, message_key
from probewire.stream.testing import SimRun

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

BOUND_S = 10.0  # the default bound of `probewire health --component worker`
SLACK_S = 3.0  # one heartbeat period and a loaded machine's process start


@pytest.fixture()
def worker(scratch_dir: Path) -> Iterator[LocalStack]:
    """A broker of its own (the test may stop it) and a worker owning a fresh store."""
    settings = Settings(
        clickhouse=ClickHouseSettings(url="chdb://" + str(scratch_dir / "store")),
        stream=StreamSettings(app_id=f"pw-health-{uuid.uuid4().hex[:8]}", metrics_port=free_port()),
    )
    stack = LocalStack(settings, scratch_dir / ".probewire-store")  # where `up --store` puts it
    stack.start_broker()
    stack.start_worker()
    yield stack
    if stack.worker is not None and stack.worker.poll() is None:
        os.killpg(stack.worker.pid, signal.SIGCONT)
    stack.stop()


def health(stack: LocalStack) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "probewire.deploy.cli", "health", "--component", "worker"]
        + ["--heartbeat", str(stack.heartbeat_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def seconds_until_unhealthy(stack: LocalStack, since: float) -> tuple[float, str]:
    """From ``since`` to the start of the first failing ``probewire health``, and its line."""
    while time.monotonic() - since < 60:
        started = time.monotonic()
        out = health(stack)
        if out.returncode != 0:
            return started - since, out.stderr.strip()
        time.sleep(0.2)
    raise AssertionError("health still passes after 60 s")


def test_a_healthy_worker_passes_and_health_store_finds_its_heartbeat_and_reader(
    worker,
) -> None:
    """``probewire health --store S`` looks next to the store (where ``up`` keeps its work
    dir), not in a fixed temp folder, and names the worker's live reader."""
    out = health(worker)
    assert out.returncode == 0, out.stderr
    store = worker.settings.clickhouse.url.removeprefix("chdb://")
    found = subprocess.run(
        [sys.executable, "-m", "probewire.deploy.cli", "health", "--component", "worker"]
        + ["--store", store],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PROBEWIRE_HEARTBEAT_DIR"},
    )
    assert found.returncode == 0, found.stderr
    assert str(worker.heartbeat_path) in found.stdout
    assert f"live reads at http://127.0.0.1:{worker.sql_port}" in found.stdout, found.stdout


def test_a_sigkilled_worker_fails_health_at_once(worker) -> None:
    """Killed: its heartbeat file stays, fresh; health sees that the writer is gone."""
    pid = json.loads(worker.heartbeat_path.read_text())["pid"]
    os.killpg(worker.worker.pid, signal.SIGKILL)
    took, line = seconds_until_unhealthy(worker, time.monotonic())
    assert took <= SLACK_S and f"pid {pid}" in line and "gone" in line, (took, line)


def test_a_sigstopped_worker_fails_health_within_its_bound(worker) -> None:
    """Frozen: its event loop writes no heartbeat, which goes stale past 10 s."""
    os.killpg(worker.worker.pid, signal.SIGSTOP)
    took, line = seconds_until_unhealthy(worker, time.monotonic())
    assert BOUND_S - SLACK_S <= took <= BOUND_S + SLACK_S and "frozen or stopped" in line, (
        took,
        line,
    )
    os.killpg(worker.worker.pid, signal.SIGCONT)  # thawed: healthy again within a beat
    deadline = time.monotonic() + 15
    while health(worker).returncode != 0:
        assert time.monotonic() < deadline, "still unhealthy after SIGCONT"
        time.sleep(0.5)


def test_a_worker_whose_broker_is_gone_fails_health_within_its_bound(worker) -> None:
    """No broker: the worker's probe of it fails; health says so within 10 s."""
    stop_process(worker.broker, signal.SIGKILL, 10.0)
    took, line = seconds_until_unhealthy(worker, time.monotonic())
    assert took <= BOUND_S and "broker unreachable" in line, (took, line)
    assert worker.worker.poll() is None  # still running: ready again once the broker is back


def produce_run(stack: LocalStack, run: SimRun, steps: int, poison=None) -> None:
    """Every rank's message of ``steps`` steps (``poison``: (step, rank) sends 1e20 tokens)."""
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for step in range(steps):
        for rank in range(run.world_size):
            values = dict(run.components(step, rank))
            if (step, rank) == poison:
                values[Loss.TOKENS] = 1e20
            who = RankIdentity(
                run_id=run.run_id, rank=rank, world_size=run.world_size, coords={"dp": rank}
            )
            data = WireEncoder(who.resource_attributes()).encode(
                step, [Point(n, v) for n, v in values.items()]
            )
            producer.produce("otlp_metrics", key=message_key(run.run_id, step), value=data)
    assert producer.flush(30) == 0


def test_metrics_shows_lag_per_partition_and_steps_stored(worker) -> None:
    """``curl /metrics`` (Prometheus text) after 6 steps: steps stored 6 for the run, a lag
    of 0 for each otlp_metrics partition it read, and the store write histogram."""
    import urllib.request

    run = SimRun(run_id=f"metrics-{uuid.uuid4().hex[:6]}", world_size=2, seed=4)
    produce_run(worker, run, 6)
    url = f"http://127.0.0.1:{worker.settings.stream.metrics_port}/metrics"
    deadline, page = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        page = urllib.request.urlopen(url, timeout=10).read().decode()
        stored = f'probewire_steps_stored_total{{run_id="{run.run_id}"}} 6.0' in page
        if stored and 'probewire_consumer_lag{partition="0",topic="otlp_metrics"}' in page:
            break  # the lag is measured once a second
        time.sleep(0.5)
    assert f'probewire_steps_stored_total{{run_id="{run.run_id}"}} 6.0' in page, page
    lags = [line for line in page.splitlines() if line.startswith("probewire_consumer_lag{")]
    assert any('topic="otlp_metrics"' in line for line in lags), page
    assert all(line.endswith(" 0.0") for line in lags if 'topic="otlp_metrics"' in line), lags
    assert "probewire_store_write_seconds_count" in page and "probewire_healthy 1.0" in page


def test_the_heartbeat_counts_steps_stored_not_steps_attempted(worker, read_store) -> None:
    """Rank 0 sends 1e20 valid tokens at step 3 (the run's cumulative token count no longer
    fits its column): whatever the store refuses, the heartbeat's ``steps_written`` equals
    the steps the store holds."""
    run = SimRun(run_id=f"poison-{uuid.uuid4().hex[:6]}", world_size=2, seed=3)
    produce_run(worker, run, 8, poison=(3, 0))
    deadline = time.monotonic() + 60
    beat: dict = {}
    while time.monotonic() < deadline:
        beat = json.loads(worker.heartbeat_path.read_text())
        if beat["runs"].get(run.run_id, {}).get("last_step") == 7 and beat["dead_letters"]:
            break
        time.sleep(0.2)
    time.sleep(2.0)  # the dead letters and the last batch settle
    beat = json.loads(worker.heartbeat_path.read_text())
    store = worker.settings.clickhouse.url.removeprefix("chdb://")
    [stored] = read_store(
        Path(store),
        f"SELECT count() AS n FROM probewire.step_metrics FINAL WHERE run_id = '{run.run_id}'",
    )
    assert beat["runs"][run.run_id]["steps_written"] == stored["n"], (beat, stored)
