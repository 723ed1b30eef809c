"""Run states that tell the truth, on the real broker, worker and store, with a real
instrumented script (``job_script.py``) as the rank: ranks SIGKILLed mid-run leave the run
``stalled`` with a ``job_state`` page within the configured silence; a pause longer than
the silence (a checkpoint save) pages, returns the run to ``running`` and stores every
step; a ``probewire run`` whose command exits 1 ends ``crashed``; a ``crashed`` event from a
rank whose clock is an hour behind ends the run ``crashed`` after rank 0's clean finish."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from probewire.deploy.session import session_env
from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
from probewire.instrument.lifecycle import run_event
from probewire.instrument.wire import RankIdentity
from probewire.stream.stage2 import Stage2Config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = Path(__file__).with_name("job_script.py")
SILENCE_S = 3.0  # stream.stage2.run_idle_s for these tests
MAX_WAIT_S = 2.0


@pytest.fixture(scope="module")
def live(kafka_bootstrap) -> Iterator[LocalStack]:
    """One worker (and store) for the module, with a short silence."""
    work = Path(tempfile.mkdtemp(prefix="pw-job-"))
    settings = Settings(
        clickhouse=ClickHouseSettings(url="chdb://" + str(work / "store")),
        stream=StreamSettings(
            app_id=f"pw-job-{uuid.uuid4().hex[:8]}",
            deadline_s=1.0,
            stage2=Stage2Config(max_wait_s=MAX_WAIT_S, run_idle_s=SILENCE_S),
        ),
    )
    stack = LocalStack(settings, work / "run")
    stack.use_broker(kafka_bootstrap)
    stack.start_worker()
    yield stack
    stack.stop()
    shutil.rmtree(work, ignore_errors=True)


def rank(stack: LocalStack, run_id: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, **session_env(stack.settings, stack.bootstrap, run_id)}
    env.update(OMP_NUM_THREADS="1", PROBEWIRE_ATTEMPT=f"test-{uuid.uuid4().hex[:6]}")
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args], env=env, stdout=subprocess.PIPE, text=True
    )


def run_progress(stack: LocalStack, run_id: str) -> dict:
    beat = json.loads(stack.heartbeat_path.read_text())
    return beat.get("runs", {}).get(run_id, {})


def wait_status(stack: LocalStack, run_id: str, status: str, timeout_s: float) -> float:
    """Seconds until the worker's heartbeat says the run is ``status``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if run_progress(stack, run_id).get("status") == status:
            return time.monotonic() - start
        time.sleep(0.1)
    raise AssertionError(
        f"run {run_id} not {status} within {timeout_s}s: {run_progress(stack, run_id)}"
    )


def store_rows(stack: LocalStack, sql: str) -> list[dict]:
    """``probewire sql --store`` (the worker serves the store it owns)."""
    store = stack.settings.clickhouse.url.removeprefix("chdb://")
    out = subprocess.run(
        [sys.executable, "-m", "probewire.deploy.cli", "sql", "--store", store]
        + ["--format", "json", sql],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_ranks_sigkilled_mid_run_leave_it_stalled_with_a_job_state_page(live) -> None:
    """The rank is SIGKILLed after 5 stored steps (no close, no crash event): within the
    silence (plus the gap wait and a tick) the run is ``stalled``, and the store holds the
    ``job_state`` page at its last step naming rank 0."""
    run_id = f"kill-{uuid.uuid4().hex[:6]}"
    proc = rank(live, run_id, "--steps", "1000", "--sleep-s", "0.2")
    try:
        deadline = time.monotonic() + 120
        while run_progress(live, run_id).get("steps_written", 0) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, "the rank stopped"
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    took = wait_status(live, run_id, "stalled", SILENCE_S + MAX_WAIT_S + 10.0)
    assert took <= SILENCE_S + MAX_WAIT_S + 10.0
    last = run_progress(live, run_id)["last_step"]
    [run] = store_rows(
        live, f"SELECT status, last_step FROM probewire.runs FINAL WHERE run_id = '{run_id}'"
    )
    assert run == {"status": "stalled", "last_step": last}
    pages = store_rows(
        live,
        f"SELECT step, ranks, message FROM probewire.alerts WHERE run_id = '{run_id}' "
        "AND signal = 'job_state'",
    )
    assert [(p["step"], p["ranks"]) for p in pages] == [(last, [0])]
    assert f"after step {last}" in pages[0]["message"]


def test_a_pause_longer_than_the_silence_pages_then_runs_again_and_stores_every_step(
    live,
) -> None:
    """A 7 s pause after step 3 (silence 3 s): the run is ``stalled`` during it, and after it
    ``running`` again, then ``finished``; every step 0-9 is stored once."""
    run_id = f"pause-{uuid.uuid4().hex[:6]}"
    proc = rank(live, run_id, "--steps", "10", "--pause-at", "3", "--pause-s", "7")
    try:
        wait_status(live, run_id, "stalled", 90)
        wait_status(live, run_id, "running", 20)
        assert proc.wait(60) == 0
    finally:
        proc.kill()
    wait_status(live, run_id, "finished", 30)
    steps = store_rows(
        live,
        f"SELECT step FROM probewire.step_metrics FINAL WHERE run_id = '{run_id}' ORDER BY step",
    )
    assert [r["step"] for r in steps] == list(range(10))
    pages = store_rows(
        live,
        f"SELECT step FROM probewire.alerts WHERE run_id = '{run_id}' AND signal = 'job_state'",
    )
    assert [p["step"] for p in pages] == [3]
    [run] = store_rows(live, f"SELECT status FROM probewire.runs FINAL WHERE run_id = '{run_id}'")
    assert run["status"] == "finished"


def test_probewire_run_whose_command_exits_1_ends_crashed(tmp_path: Path) -> None:
    """The command sends 3 steps and exits 1 without a word from any rank: ``probewire run``
    records ``crashed``, prints it, and returns 1."""
    store = tmp_path / "store"
    out = subprocess.run(
        [sys.executable, "-m", "probewire.deploy.cli", "run", "--store", str(store)]
        + ["--run-id", "crash1", "--", sys.executable, str(SCRIPT), "--steps", "3"]
        + ["--exit-code", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert "run crash1: crashed, 3 steps stored" in out.stdout, out.stdout
    [run] = json.loads(
        subprocess.run(
            [sys.executable, "-m", "probewire.deploy.cli", "sql", "--store", str(store)]
            + [
                "--format",
                "json",
                "SELECT status FROM probewire.runs FINAL WHERE run_id = 'crash1'",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
    )
    assert run["status"] == "crashed"


def test_a_crash_from_a_rank_an_hour_behind_ends_the_run_crashed(live) -> None:
    """Rank 0 starts and finishes the attempt by its clock; rank 1, whose clock is an hour
    behind, crashed at step 4: the worker stores the run ``crashed`` with rank 1's error
    (issue 40: the crash, older than the start by its time, was ignored: ``finished``)."""
    from confluent_kafka import Producer

    run_id, attempt = f"skew-{uuid.uuid4().hex[:6]}", f"skew-{uuid.uuid4().hex[:6]}"
    now, hour = time.time_ns(), 3600 * 10**9

    def who(r: int) -> RankIdentity:
        return RankIdentity(run_id=run_id, rank=r, world_size=2, host=f"h{r}", coords={})

    events = [
        run_event(who(0), "started", config={"lr": 1e-3}, now_ns=now, attempt=attempt),
        run_event(who(0), "finished", now_ns=now + 10**9, step=5, attempt=attempt),
        run_event(who(1), "crashed", error="boom", now_ns=now - hour, step=4, attempt=attempt),
    ]
    producer = Producer({"bootstrap.servers": live.bootstrap})
    for body in events:
        producer.produce(live.settings.topics.runs, key=run_id.encode(), value=body)
    assert producer.flush(30) == 0
    deadline = time.monotonic() + 60
    rows: list[dict] = []
    while time.monotonic() < deadline:
        rows = store_rows(
            live, f"SELECT status FROM probewire.runs FINAL WHERE run_id = '{run_id}'"
        )
        if rows and rows[0]["status"] == "crashed":
            break
        time.sleep(0.5)
    assert rows == [{"status": "crashed"}]
