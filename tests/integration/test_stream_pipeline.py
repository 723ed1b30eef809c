"""The stream on the real broker and the real ClickHouse engine, with 8 simulated ranks.

Uneven valid-token counts, a rank with no valid token, one rank missing on two steps, a
duplicated message and one injected co-spike; then the same run with the worker killed
mid-run and restarted, which must store exactly what the uninterrupted run stored.
"""

from __future__ import annotations

import base64
import json
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Producer

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack, stop_process
from probewire.stream.retention import retained_steps
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import Stage2Config
from probewire.stream.testing import SimRun, own_topics, send

pytestmark = pytest.mark.integration

STEPS, COSPIKE, MISSING = 80, 50, {30: {7}, 31: {7}}
RETENTION = dict(k=10, halo=5, warmup_steps=5, final_steps=5)


def sim(run_id: str) -> SimRun:
    return SimRun(
        run_id=run_id,
        world_size=8,
        steps=STEPS,
        seed=7,
        missing=MISSING,
        empty={(12, 3), (40, 0)},
        cospike_step=COSPIKE,
        net=True,
    )


def settings_for(store: Path) -> Settings:
    tag = uuid.uuid4().hex[:8]
    return Settings(
        clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/")),
        topics=own_topics(tag),  # the session's broker holds other tests' poison
        stream=StreamSettings(
            app_id=f"pw-test-{tag}",
            deadline_s=3.0,
            stage2=Stage2Config(
                detectors=DetectorConfig(window=20),
                retention_every_k=RETENTION["k"],
                retention_halo=RETENTION["halo"],
                warmup_steps=RETENTION["warmup_steps"],
                final_steps=RETENTION["final_steps"],
                max_wait_s=13.0,
                run_idle_s=3.0,
            ),
        ),
    )


def wait_finished(stack: LocalStack, run_id: str, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        beat = json.loads(stack.heartbeat_path.read_text()) if stack.heartbeat_path.exists() else {}
        if beat.get("runs", {}).get(run_id, {}).get("finished"):
            return
        time.sleep(0.3)
    raise AssertionError(
        f"run {run_id} not finished; heartbeat: "
        f"{stack.heartbeat_path.read_text() if stack.heartbeat_path.exists() else None}"
    )


def read_run(read_store, store: Path, run_id: str) -> dict[str, list[dict]]:
    q = f"WHERE run_id = '{run_id}'"
    return {
        "steps": read_store(
            store,
            f"SELECT * EXCEPT inserted_at FROM probewire.step_metrics FINAL {q} ORDER BY step",
        ),
        "anomalies": read_store(
            store,
            f"SELECT step, signal, kind FROM probewire.anomalies FINAL {q} ORDER BY step, signal",
        ),
        "alerts": read_store(
            store,
            f"SELECT step, signal, ranks FROM probewire.alerts FINAL {q} ORDER BY step, signal",
        ),
        "retained": [
            r["step"]
            for r in read_store(
                store, f"SELECT DISTINCT step FROM probewire.rank_metrics FINAL {q} ORDER BY step"
            )
        ],
        "rank_rows": read_store(
            store, f"SELECT count() AS n FROM probewire.rank_metrics FINAL {q}"
        ),
    }


@pytest.fixture(scope="module")
def uninterrupted(kafka_bootstrap, tmp_path_factory, read_store):
    base = tmp_path_factory.mktemp("stream-straight")
    run = sim(f"straight-{uuid.uuid4().hex[:6]}")
    stack = LocalStack(settings_for(base / "store"), base / "run")
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        send(
            run, kafka_bootstrap, stack.settings.topics.metrics, range(STEPS), duplicates=[(20, 3)]
        )
        producer = Producer({"bootstrap.servers": kafka_bootstrap})
        producer.produce(
            stack.settings.topics.metrics, key=f"{run.run_id}:999".encode(), value=b"not otlp"
        )
        producer.flush(10)
        wait_finished(stack, run.run_id)
        time.sleep(1.5)  # the dead-letter agent batches for up to 1 s
    finally:
        stack.stop()
    got = read_run(read_store, base / "store", run.run_id)
    got["dead_letters"] = read_store(
        base / "store", "SELECT reason, payload_b64 FROM probewire.dead_letters FINAL"
    )
    app_id = stack.settings.stream.app_id
    got["faust_dirs"] = {
        "work dir": (stack.heartbeat_path.parent / f"faust-{app_id}").is_dir(),
        "cwd": Path(f"{app_id}-data").exists(),
    }
    return run, got


def test_worker_keeps_its_faust_data_dir_out_of_the_working_directory(uninterrupted):
    assert uninterrupted[1]["faust_dirs"] == {"work dir": True, "cwd": False}


def test_loss_and_worst_rank_loss_are_exact_every_step(uninterrupted):
    run, got = uninterrupted
    assert [r["step"] for r in got["steps"]] == list(range(STEPS))
    for row in got["steps"]:
        expected_l, expected_max = run.expected(row["step"])
        assert row["loss"] == pytest.approx(expected_l, rel=1e-9, abs=0)
        assert row["loss_worst_rank"] == pytest.approx(expected_max, rel=1e-9, abs=0)


def test_missing_rank_is_reported_and_duplicate_is_not_counted(uninterrupted):
    run, got = uninterrupted
    by_step = {r["step"]: r for r in got["steps"]}
    assert by_step[30]["ranks_missing"] == [7] and by_step[30]["ranks_reporting"] == 7
    assert by_step[29]["ranks_missing"] == [] and by_step[29]["ranks_reporting"] == 8
    tokens_20 = sum(run.components(20, r)["loss.tokens"] for r in range(8))
    assert by_step[20]["step_tokens"] == tokens_20  # rank 3's duplicate counted once


def test_network_bytes_are_summed_over_both_nodes_every_step(uninterrupted):
    """net.rx / net.tx come from each node's local rank 0 (ranks 0 and 4 of node0 and
    node1): every step stores their float64 sums, not rank 0's alone."""
    run, got = uninterrupted
    for row in got["steps"]:
        parts = [run.components(row["step"], r) for r in (0, 4)]
        for column, metric in (("net_rx_bytes", "net.rx"), ("net_tx_bytes", "net.tx")):
            sent = np.array([p[metric] for p in parts], dtype=np.float64)
            assert row[column] == np.sum(sent) and np.all(sent > 0), (row["step"], column)


def test_malformed_message_is_dead_lettered_with_its_reason(uninterrupted):
    _, got = uninterrupted
    (letter,) = got["dead_letters"]
    assert letter["reason"].startswith("not an OTLP")
    assert base64.b64decode(letter["payload_b64"]) == b"not otlp"


def test_exactly_one_cospike_at_the_injected_step(uninterrupted):
    _, got = uninterrupted
    assert [r["step"] for r in got["steps"] if r["cospike"]] == [COSPIKE]
    assert [(a["step"], a["signal"]) for a in got["alerts"] if a["signal"] == "cospike"] == [
        (COSPIKE, "cospike")
    ]
    counts = [r["cospike_count"] for r in got["steps"]]
    assert counts[COSPIKE - 1] == 0 and counts[COSPIKE] == 1 and counts[-1] == 1


def test_retained_steps_are_exactly_what_the_policy_names(uninterrupted):
    _, got = uninterrupted
    anomaly_steps = {a["step"] for a in got["anomalies"]}
    # the missing rank (job state: an anomaly at 30, the page on its second missing step,
    # 31) and the co-spike
    assert anomaly_steps == {30, 31, COSPIKE}
    assert [(a["step"], a["ranks"]) for a in got["alerts"] if a["signal"] == "ranks_missing"] == [
        (31, [7])
    ]
    assert got["retained"] == sorted(retained_steps(STEPS, anomaly_steps, **RETENTION))


def test_restart_mid_run_stores_exactly_what_the_uninterrupted_run_stored(
    uninterrupted, kafka_bootstrap, tmp_path_factory, read_store
):
    straight_run, straight = uninterrupted
    base = tmp_path_factory.mktemp("stream-restart")
    run = sim(f"restart-{uuid.uuid4().hex[:6]}")
    stack = LocalStack(settings_for(base / "store"), base / "run")
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        send(run, kafka_bootstrap, stack.settings.topics.metrics, range(45), duplicates=[(20, 3)])
        deadline = time.monotonic() + 60
        while stack.progress(run.run_id) < 35 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert stack.progress(run.run_id) >= 35
        stop_process(stack.worker, signal.SIGKILL)  # a crash: no flush, no clean leave
        send(run, kafka_bootstrap, stack.settings.topics.metrics, range(45, STEPS))
        stack.start_worker()
        wait_finished(stack, run.run_id)
    finally:
        stack.stop()
    got = read_run(read_store, base / "store", run.run_id)

    def same(rows):
        # complete_reason (all_ranks / later_step / deadline) depends on arrival timing
        return [
            {k: v for k, v in r.items() if k not in ("run_id", "complete_reason")} for r in rows
        ]

    assert same(got["steps"]) == same(straight["steps"])
    assert got["anomalies"] == straight["anomalies"]
    assert got["alerts"] == straight["alerts"]
    assert got["retained"] == straight["retained"]
    assert got["rank_rows"] == straight["rank_rows"]
