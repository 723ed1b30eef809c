"""Issue 14 on the real broker, worker and store: an ordinary day of a real run loses
nothing. Each scenario ends with every step stored exactly once and the P0 series (L,
L_max, G2, tau, TPS) equal to the float64 reference of the same input (what an
undisturbed run stores), and the worker still running.

Pause longer than ``run_idle_s`` then resume; a late step after a skipped gap; poison
values (one dead letter each: an out-of-range label, step 2^62, world size 5,000,000, a
world size that disagrees, garbage, null payloads, a non-integer rank, label values
over the per-run cap); a store outage past the retry window (health fails, then
everything is stored); a crashed agent (health fails naming it and stays failed after
Faust restarts the agent; a restart stores its input); a step over the message size
limit (split, P0 and all detail stored); a broker restart mid-run with the documented
recovery; a message limit over the broker's (one line at start); an unreachable store
whose URL holds a password (retried, health names the store, the password never logged).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Producer

from probewire.deploy.reading import open_client
from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack, StackError, free_port, spawn, stop_process
from probewire.instrument.catalog import Grad, Label, Loss, Moe, System, Tensor
from probewire.instrument.wire import RANK_ATTR, Point, RankIdentity, WireEncoder, message_key
from probewire.stream.health import HealthConfig
from probewire.stream.records import ReducedStep
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import Stage2Config
from probewire.stream.testing import SimRun, own_topics
from probewire.stream.validate import Bounds

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RANKS = 4


def settings_for(store: Path, **stream) -> Settings:
    stage2 = Stage2Config(
        detectors=DetectorConfig(window=10),
        retention_every_k=5,
        retention_halo=2,
        warmup_steps=2,
        final_steps=2,
        max_wait_s=stream.pop("max_wait_s", 3.0),
        run_idle_s=stream.pop("run_idle_s", 60.0),
    )
    return Settings(
        clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/"), retry_max_s=1.0),
        stream=StreamSettings(
            app_id=f"pw-grade-{uuid.uuid4().hex[:8]}",
            deadline_s=stream.pop("deadline_s", 2.0),
            stage2=stage2,
            health=HealthConfig(stall_s=max(6.0, stage2.max_wait_s + 1.0)),
            **stream,
        ),
    )


def encode(
    run: SimRun, step: int, extra=(), identity=None, ranks: range | None = None
) -> list[tuple[bytes, bytes]]:
    """The messages of one step from ``ranks`` (default: every rank), encoded by the ranks'
    own wire encoder (the emitter's thread and queue add nothing to test here)."""
    out = []
    for rank in range(run.world_size) if ranks is None else ranks:
        who = (
            identity(rank)
            if identity
            else RankIdentity(
                run_id=run.run_id,
                rank=rank,
                world_size=run.world_size,
                host=f"h{rank}",
                coords={"dp": rank},
            )
        )
        points = [Point(n, v) for n, v in run.components(step, rank).items()] + list(extra)
        out.append(
            (
                message_key(who.run_id, step),
                WireEncoder(who.resource_attributes()).encode(step, points),
            )
        )
    return out


def produce(bootstrap: str, messages, topic: str = "otlp_metrics") -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for key, value in messages:
        producer.produce(topic, key=key, value=value)
    assert producer.flush(30) == 0


def wait_for(stack: LocalStack, run_id: str, steps: int, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while stack.progress(run_id) < steps and time.monotonic() < deadline:
        assert stack.worker.poll() is None, "the worker exited"
        time.sleep(0.2)
    assert stack.progress(run_id) >= steps, stack.heartbeat_path.read_text()


def wait_stored(stack: LocalStack, table: str, rows: int, timeout_s: float = 30.0) -> None:
    """Until the worker has stored ``rows`` rows of ``table`` (its heartbeat says so)."""

    def stored() -> int:
        beat = json.loads(stack.heartbeat_path.read_text())
        return beat.get("stages", {}).get(table, {}).get("outputs", 0)

    deadline = time.monotonic() + timeout_s
    while stored() < rows and time.monotonic() < deadline:
        time.sleep(0.2)
    assert stored() >= rows, stack.heartbeat_path.read_text()


def health(stack: LocalStack) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "probewire.deploy.cli",
            "health",
            "--component",
            "worker",
            "--heartbeat",
            str(stack.heartbeat_path),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def reference(run: SimRun, step: int) -> dict[str, float]:
    """What an undisturbed run stores for ``step``, in float64 from the ranks' components."""
    parts = [c for r in range(run.world_size) if (c := run.components(step, r)) is not None]
    column = lambda name: np.array([c[name] for c in parts], dtype=np.float64)  # noqa: E731
    loss, worst = run.expected(step)
    tau = float(np.max(column(System.STEP_TIME)))
    return {
        "loss": loss,
        "loss_worst_rank": worst,
        "grad_norm": float(np.sqrt(np.sum(column(Grad.NORM_SQ)))),
        "step_time_s": tau,
        "tokens_per_s": float(np.sum(column(Loss.TOKENS))) / tau,
    }


def assert_exact(read_store, store: Path, run: SimRun, steps: list[int]) -> list[dict]:
    """Every step stored once, its P0 series equal to the float64 reference."""
    rows = read_store(
        store,
        "SELECT step, loss, loss_worst_rank, grad_norm, step_time_s, "
        "tokens_per_s, complete_reason, count() OVER (PARTITION BY step) "
        "AS copies FROM probewire.step_metrics FINAL WHERE run_id = "
        f"'{run.run_id}' ORDER BY step",
    )
    assert [r["step"] for r in rows] == steps
    assert all(r["copies"] == 1 for r in rows)
    for row in rows:
        for name, value in reference(run, row["step"]).items():
            assert row[name] == pytest.approx(value, rel=1e-9, abs=0), (row["step"], name)
    return rows


@pytest.fixture()
def stack(kafka_bootstrap, scratch_dir, request):
    made = []

    def start(**stream) -> LocalStack:
        s = LocalStack(settings_for(scratch_dir / "store", **stream), scratch_dir / "run")
        made.append(s)
        s.use_broker(kafka_bootstrap)
        s.start_worker()
        return s

    yield start
    for s in made:
        s.stop()


def test_a_pause_longer_than_run_idle_s_then_resume_stores_every_step(
    stack, kafka_bootstrap, read_store, scratch_dir
):
    s = stack(run_idle_s=2.0)
    run = SimRun(run_id=f"pause-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=1)
    produce(kafka_bootstrap, [m for step in range(10) for m in encode(run, step)])
    wait_for(s, run.run_id, 10)
    time.sleep(4.0)  # idle: the run is finished, then finished again (no crash, no raise)
    assert json.loads(s.heartbeat_path.read_text())["runs"][run.run_id]["finished"]
    produce(kafka_bootstrap, [m for step in range(10, 20) for m in encode(run, step)])
    wait_for(s, run.run_id, 20)
    s.stop()
    assert s.worker.returncode in (0, -15, 143)
    assert_exact(read_store, scratch_dir / "store", run, list(range(20)))


def test_a_worker_stopped_while_it_holds_a_partial_step_exits_and_the_step_is_not_lost(
    stack, kafka_bootstrap, read_store, scratch_dir
):
    """SIGTERM while rank messages wait unacknowledged for their step's last rank: the worker
    stops by itself (Faust's default waited for them until the stack killed it), and a
    restarted worker gets them again and stores the step once it is complete."""
    s = stack(deadline_s=30.0, max_wait_s=40.0)  # the partial step is not published as late
    run = SimRun(run_id=f"held-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=5)
    produce(
        kafka_bootstrap,
        [m for step in range(5) for m in encode(run, step)]
        + encode(run, 5, ranks=range(RANKS - 1)),
    )
    wait_for(s, run.run_id, 5)
    time.sleep(1.0)  # step 5's messages reach the worker, which holds them
    os.killpg(s.worker.pid, signal.SIGTERM)
    assert s.worker.wait(timeout=20) in (0, -15, 143)  # not killed by the stack's timeout
    s.start_worker()  # the same group: resumes at its committed offsets
    produce(kafka_bootstrap, encode(run, 5, ranks=range(RANKS - 1, RANKS)))
    deadline = time.monotonic() + 90  # (the heartbeat counts this process's writes)
    while s.progress(run.run_id, "last_step") < 5 and time.monotonic() < deadline:
        assert s.worker.poll() is None, "the worker exited"
        time.sleep(0.2)
    s.stop()
    rows = assert_exact(read_store, scratch_dir / "store", run, list(range(6)))
    assert rows[5]["complete_reason"] == rows[0]["complete_reason"]  # complete, not late


def test_a_step_after_its_gap_was_skipped_is_stored_flagged_and_its_cospike_pages(
    stack, kafka_bootstrap, read_store, scratch_dir
):
    """Step 10, a co-spike, comes after max_wait_s skipped its gap: it is stored flagged
    and still pages, its page saying it is late (issue 40: it paged nothing)."""
    s = stack()
    run = SimRun(run_id=f"gap-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=2, cospike_step=10)
    produce(
        kafka_bootstrap, [m for step in [*range(10), *range(11, 30)] for m in encode(run, step)]
    )
    wait_for(s, run.run_id, 29)  # step 10's gap skipped after max_wait_s
    produce(kafka_bootstrap, encode(run, 10))
    wait_for(s, run.run_id, 30)
    s.stop()
    rows = assert_exact(read_store, scratch_dir / "store", run, list(range(30)))
    assert [r["step"] for r in rows if r["complete_reason"] == "after_gap"] == [10]
    alerts = read_store(
        scratch_dir / "store",
        "SELECT step, signal, message FROM probewire.alerts FINAL "
        f"WHERE run_id = '{run.run_id}' AND signal = 'cospike'",
    )
    assert [(a["step"], a["signal"]) for a in alerts] == [(10, "cospike")]
    assert "late: this step arrived after stream.stage2.max_wait_s" in alerts[0]["message"]


def test_a_restart_reads_again_a_held_rank_message_that_later_acknowledged_steps_follow(
    kafka_bootstrap, read_store, scratch_dir
):
    """One partition of fresh topics: step 0's rank 0 message (offset 0) waits for its
    step while steps 1-5 after it complete and are acknowledged; the worker stops and a
    new one starts in the same group; rank 1-3's step 0 messages then come. Step 0 is
    stored with all 4 ranks: the commit stopped at offset 0. (Faust committed offset 21
    past the held message, the restarted worker never read it, and step 0 was reduced
    without rank 0: the loss of test_stage1_workers when a rebalance moved a partition.)"""
    base = settings_for(scratch_dir / "store", deadline_s=8.0, max_wait_s=10.0)
    topics = own_topics(uuid.uuid4().hex[:8])
    s = LocalStack(dataclasses.replace(base, topics=topics), scratch_dir / "run")
    run = SimRun(run_id=f"commit-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=6)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})

    def to_partition_0(messages) -> None:
        for key, value in messages:
            producer.produce(topics.metrics, key=key, value=value, partition=0)
        assert producer.flush(30) == 0

    try:
        s.use_broker(kafka_bootstrap)
        s.start_worker()
        to_partition_0(encode(run, 0, ranks=range(1)))
        to_partition_0([m for step in range(1, 6) for m in encode(run, step)])
        time.sleep(6.0)  # steps 1-5 published and acknowledged; Faust commits every 2.8 s
        os.killpg(s.worker.pid, signal.SIGTERM)
        assert s.worker.wait(timeout=20) in (0, -15, 143)
        s.start_worker()  # the same group: resumes at its committed offsets
        to_partition_0(encode(run, 0, ranks=range(1, RANKS)))
        deadline = time.monotonic() + 90
        while s.progress(run.run_id, "last_step") < 5 and time.monotonic() < deadline:
            assert s.worker.poll() is None, "the worker exited"
            time.sleep(0.2)
    finally:
        s.stop()
    rows = assert_exact(read_store, scratch_dir / "store", run, list(range(6)))
    assert rows[0]["complete_reason"] == "all_ranks"


def test_rank_messages_out_of_order_never_reduce_a_step_without_a_rank(
    stack, kafka_bootstrap, read_store, scratch_dir
):
    """Ranks 0, 2 and 3 send steps 0-39, then rank 1 sends them newest first: each later
    step completes before the earlier ones (some of them in its partition), which still
    wait for rank 1, well within the deadline. Every step is stored with all 4 ranks and the
    reference's values, and no ranks_missing anomaly or page is recorded (issue 40: a later
    step completing in the same partition closed the earlier ones without rank 1: 181 of
    200 steps, and a false ranks_missing page)."""
    s = stack(deadline_s=20.0, max_wait_s=25.0)
    run = SimRun(run_id=f"order-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=5)
    messages = [
        m
        for step in range(40)
        for ranks in (range(1), range(2, RANKS))
        for m in encode(run, step, ranks=ranks)
    ]
    messages += [m for step in reversed(range(40)) for m in encode(run, step, ranks=range(1, 2))]
    produce(kafka_bootstrap, messages)
    wait_for(s, run.run_id, 40, timeout_s=60)
    s.stop()
    rows = assert_exact(read_store, scratch_dir / "store", run, list(range(40)))
    assert {r["complete_reason"] for r in rows} == {"all_ranks"}
    missing = read_store(
        scratch_dir / "store",
        "SELECT step, signal FROM probewire.anomalies FINAL "
        f"WHERE run_id = '{run.run_id}' AND signal = 'ranks_missing'",
    )
    assert missing == []


def test_poison_values_are_one_dead_letter_each_and_the_run_is_stored_exactly(
    stack, kafka_bootstrap, read_store, scratch_dir
):
    s = stack(bounds=Bounds(max_label_values=20))
    run = SimRun(run_id=f"poison-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=3)
    one = range(1)
    other = SimRun(run_id=run.run_id, world_size=RANKS)
    bad_expert = [Point(Moe.EXPERT_TOKENS, 5.0, ((Label.LAYER, "0"), (Label.EXPERT, "-1")))]
    word_rank = RankIdentity(run_id=run.run_id, rank=1, world_size=RANKS).resource_attributes()
    word_rank[RANK_ATTR] = "one"
    poison = [
        encode(other, 3, bad_expert, ranks=one),
        encode(other, 2**62, ranks=one),
        encode(SimRun(run_id="huge", world_size=5_000_000), 0, ranks=one),
        encode(
            other,
            4,
            ranks=range(1, 2),
            identity=lambda r: RankIdentity(run_id=run.run_id, rank=r, world_size=RANKS + 1),
        ),
        [(f"{run.run_id}:5".encode(), b"\x00garbage")],
        [(f"{run.run_id}:5".encode(), None)] * 20,  # null payloads, one letter each
        [
            (
                f"{run.run_id}:5".encode(),
                WireEncoder(word_rank).encode(
                    5, [Point(n, v) for n, v in other.components(5, 1).items()]
                ),
            )
        ],
    ]
    good = [m for step in range(12) for m in encode(run, step)]
    # rank 0 of step 6 names 30 loss sources: 20 are kept, the other 10 are dropped (one
    # dead letter with the reason) and the rest of its message is reduced as usual
    sources = [
        Point(name, 1.0, ((Label.SOURCE, f"src{i}"),))
        for i in range(30)
        for name in (Loss.SUM, Loss.TOKENS)
    ]
    good[24:25] = encode(run, 6, sources, ranks=one)
    produce(kafka_bootstrap, good[:20] + [m for p in poison for m in p] + good[20:])
    wait_for(s, run.run_id, 12)
    # stage 2's own input, written by someone other than stage 1: garbage, and a reduced
    # step with a loss sum on a rank that has no token (derive's rules refuse it)
    bad = [
        ReducedStep(
            run_id=run.run_id,
            step=step,
            world_size=2,
            ranks_reporting=[0, 1],
            ranks_missing=[],
            reduced={(Loss.SUM, ()): 5.0, (Loss.TOKENS, ()): 1.0},
            per_rank={
                0: {(Loss.SUM, ()): 3.0, (Loss.TOKENS, ()): 1.0},
                1: {(Loss.SUM, ()): 2.0, (Loss.TOKENS, ()): 0.0},
            },
        )
        for step in (12, 13)
    ]  # two letters with no input offset: both kept
    produce(
        kafka_bootstrap,
        [(run.run_id.encode(), b"garbage")] + [(run.run_id.encode(), b.to_bytes()) for b in bad],
        topic="probewire.steps",
    )
    wait_stored(s, "dead_letters", 4 + sum(map(len, poison)))
    s.stop()
    store = scratch_dir / "store"
    assert_exact(read_store, store, run, list(range(12)))
    letters = read_store(store, "SELECT key, reason FROM probewire.dead_letters FINAL")
    assert len(letters) == 4 + sum(map(len, poison)), letters
    # each letter keeps its message's key (run and step), the garbage on stage 2's topic too
    assert {r["key"] for r in letters if "disagrees" in r["reason"]} == {f"{run.run_id}:4"}
    assert {r["key"] for r in letters if "not a reduced step" in r["reason"]} == {run.run_id}
    reasons = " | ".join(sorted(r["reason"] for r in letters))
    for expected in (
        "label expert",
        "step 4611686018427387904",
        "world size 5000000",
        "disagrees",
        "not an OTLP",
        "empty payload",
        "must be an integer",
        "label source",
        "not a reduced step",
        "step 12 of run",
        "step 13 of run",
    ):
        assert expected in reasons, reasons
    kept = read_store(
        store,
        "SELECT step, count() AS n FROM probewire.source_metrics FINAL "
        f"WHERE run_id = '{run.run_id}' GROUP BY step",
    )
    assert [(r["step"], r["n"]) for r in kept] == [(6, 20)]


def test_sums_past_the_float64_range_or_of_opposite_infinities_are_stored_as_numpy_sums(
    stack, kafka_bootstrap, read_store, scratch_dir
):
    """Step 3's loss sums are +inf on rank 0 and -inf on rank 1 (Σ: NaN); step 4's are
    1e308 on every rank (Σ past float64's range: +inf). Stage 1 once crashed on both (an
    exact sum raises on them); now each step is stored with the value NumPy's float64 sum
    gives, and every other step exactly, with the worker still running."""
    s = stack()
    run = SimRun(run_id=f"range-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=4)
    odd = {3: {0: math.inf, 1: -math.inf}, 4: {r: 1e308 for r in range(RANKS)}}
    messages = []
    for step in range(8):
        for rank in range(RANKS):
            parts = run.components(step, rank) | (
                {Loss.SUM: odd[step][rank]} if rank in odd.get(step, {}) else {}
            )
            who = RankIdentity(run_id=run.run_id, rank=rank, world_size=RANKS, host=f"h{rank}")
            messages.append(
                (
                    message_key(run.run_id, step),
                    WireEncoder(who.resource_attributes()).encode(
                        step, [Point(n, v) for n, v in parts.items()]
                    ),
                )
            )
    produce(kafka_bootstrap, messages)
    wait_for(s, run.run_id, 8)
    assert s.worker.poll() is None, "the worker exited"
    s.stop()
    # JSON has no NaN or inf: the non-finite ones are read back by name
    rows = read_store(
        scratch_dir / "store",
        "SELECT step, loss AS value, toString(loss) AS "
        "text FROM probewire.step_metrics FINAL WHERE run_id = "
        f"'{run.run_id}' ORDER BY step",
    )
    assert [r["step"] for r in rows] == list(range(8))
    for row in rows:
        step = row["step"]
        row["loss"] = float(row["text"]) if row["value"] is None else row["value"]
        sums = np.array(
            [odd.get(step, {}).get(r, run.components(step, r)[Loss.SUM]) for r in range(RANKS)],
            dtype=np.float64,
        )
        tokens = np.array([run.components(step, r)[Loss.TOKENS] for r in range(RANKS)])
        with np.errstate(over="ignore", invalid="ignore"):
            expected = float(np.sum(sums) / np.sum(tokens))
        assert row["loss"] == pytest.approx(expected, rel=1e-9, abs=0, nan_ok=True), step
    assert math.isnan(rows[3]["loss"]) and rows[4]["loss"] == math.inf


def test_a_store_outage_past_the_retry_window_fails_health_then_stores_everything(
    stack, kafka_bootstrap, read_store, scratch_dir, monkeypatch
):
    flag = scratch_dir / "outage"
    monkeypatch.setenv("PROBEWIRE_FAULT_STORE_OUTAGE", str(flag))
    s = stack()
    run = SimRun(run_id=f"outage-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=4)
    produce(kafka_bootstrap, [m for step in range(5) for m in encode(run, step)])
    wait_for(s, run.run_id, 5)
    flag.touch()
    produce(kafka_bootstrap, [m for step in range(5, 15) for m in encode(run, step)])
    deadline = time.monotonic() + 60
    while health(s).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    failing = health(s)
    assert failing.returncode == 1 and "stage2" in failing.stderr, failing
    assert s.progress(run.run_id) == 5
    flag.unlink()
    wait_for(s, run.run_id, 15)
    deadline = time.monotonic() + 20
    while health(s).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert health(s).returncode == 0
    s.stop()
    assert_exact(read_store, scratch_dir / "store", run, list(range(15)))


def test_health_fails_while_an_agent_is_crashed_and_a_restart_stores_its_input(
    stack, kafka_bootstrap, read_store, scratch_dir, monkeypatch
):
    monkeypatch.setenv("PROBEWIRE_FAULT_CRASH_AGENT", "per_run")
    s = stack()  # (a fresh group: it may crash at once on another test's steps)
    run = SimRun(run_id=f"crash-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=5)
    produce(kafka_bootstrap, [m for step in range(5) for m in encode(run, step)])
    deadline = time.monotonic() + 30
    while health(s).returncode == 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    result = health(s)
    assert result.returncode == 1 and "agent per_run crashed" in result.stderr, result
    time.sleep(1.5)  # Faust restarted the agent; the worker must stay unhealthy
    assert health(s).returncode == 1
    # what an orchestrator does on a failing liveness check: kill, start again
    stop_process(s.worker, signal.SIGKILL)
    monkeypatch.delenv("PROBEWIRE_FAULT_CRASH_AGENT")
    s.start_worker()
    wait_for(s, run.run_id, 5)
    assert health(s).returncode == 0
    s.stop()
    assert_exact(read_store, scratch_dir / "store", run, list(range(5)))


def test_a_step_over_the_message_limit_is_split_and_stored_whole(
    stack, kafka_bootstrap, read_store, scratch_dir
):
    s = stack(max_message_bytes=20_000)
    run = SimRun(run_id=f"big-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=6)
    tensors = [
        Point(name, 1.0, ((Label.KIND, "fwd"), (Label.TENSOR, f"t{t}")))
        for t in range(40)
        for name in Tensor.ALL
    ]
    messages = [m for step in range(6) for m in encode(run, step, tensors)]
    produce(kafka_bootstrap, messages)
    wait_for(s, run.run_id, 6)
    # the detail parts travel apart (probewire.detail_steps) and are written after the
    # steps' rows, on the step tier's turn: read live until the retained ones are in
    per_rank = len(run.components(0, 0)) + len(tensors)
    retained = (
        "SELECT step, count() AS n FROM probewire.rank_metrics FINAL "
        f"WHERE run_id = '{run.run_id}' AND step < 2 GROUP BY step ORDER BY step"
    )
    live, deadline, counts = open_client(s.settings.clickhouse.url), time.monotonic() + 60, []
    while counts != [(0, RANKS * per_rank), (1, RANKS * per_rank)] and time.monotonic() < deadline:
        time.sleep(0.2)
        counts = [tuple(r) for r in live.query(retained).result_rows]
    s.stop()
    store = scratch_dir / "store"
    assert_exact(read_store, store, run, list(range(6)))
    # warm-up steps 0 and 1 are retained: every rank's every point, every tensor row
    ranks = read_store(
        store,
        "SELECT step, count() AS n FROM probewire.rank_metrics FINAL "
        f"WHERE run_id = '{run.run_id}' GROUP BY step ORDER BY step",
    )
    assert [(r["step"], r["n"]) for r in ranks][:2] == [
        (0, RANKS * per_rank),
        (1, RANKS * per_rank),
    ]
    rows = read_store(
        store,
        "SELECT count() AS n FROM probewire.tensor_stats FINAL "
        f"WHERE run_id = '{run.run_id}' AND step = 0",
    )
    assert rows == [{"n": 40}]


def test_a_broker_restart_mid_run_with_the_documented_recovery_stores_every_step_once(
    read_store, scratch_dir
):
    """docs/deployment.md, "The broker restarts" (Tansu, memory storage): topics recreated
    (with the broker), the worker restarted, the ranks re-send after the last stored step
    with a generous window; nothing is lost and nothing stored twice."""
    store = scratch_dir / "store"
    s = LocalStack(settings_for(store), scratch_dir / "run")
    try:
        bootstrap = s.start_broker()
        s.start_worker()
        run = SimRun(run_id=f"restart-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=7)
        produce(bootstrap, [m for step in range(15) for m in encode(run, step)])
        wait_for(s, run.run_id, 10)
        s.restart_broker()  # mid-run: steps 10..14 may be anywhere between rank and store
        stop_process(s.worker, signal.SIGTERM, 30.0)  # (2) restart the worker
        [last] = read_store(
            store,
            "SELECT max(step) AS m FROM probewire.step_metrics FINAL "
            f"WHERE run_id = '{run.run_id}'",
        )
        assert 9 <= last["m"] <= 14
        s.start_worker()
        # (3) the ranks re-send after the last stored step, with a window of 5 before it
        produce(bootstrap, [m for step in range(last["m"] - 5, 20) for m in encode(run, step)])
        deadline = time.monotonic() + 90
        while s.progress(run.run_id, "last_step") < 19 and time.monotonic() < deadline:
            assert s.worker.poll() is None, "the worker exited"
            time.sleep(0.2)
        assert s.progress(run.run_id, "last_step") == 19, s.heartbeat_path.read_text()
        assert health(s).returncode == 0
    finally:
        s.stop()
    assert_exact(read_store, store, run, list(range(20)))


def test_a_message_limit_over_the_brokers_stops_the_worker_at_start_with_one_line(
    kafka_bootstrap, scratch_dir
):
    """stream.max_message_bytes is compared with the topics' max.message.bytes at start."""
    from confluent_kafka.admin import AdminClient, NewTopic

    steps = f"steps-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([NewTopic(steps, 1, 1, config={"max.message.bytes": "50000"})])[
        steps
    ].result(30)
    settings = settings_for(scratch_dir / "store", max_message_bytes=100_000)
    settings.topics = dataclasses.replace(settings.topics, steps=steps)
    s = LocalStack(settings, scratch_dir / "run")
    s.use_broker(kafka_bootstrap)
    try:
        with pytest.raises(StackError, match="exited with code 2"):
            s.start_worker(timeout_s=60)
    finally:
        s.stop()
    lines = [
        line
        for line in (scratch_dir / "run" / "worker.log").read_text().splitlines()
        if line.startswith("probewire: error:")
    ]
    assert lines == [
        "probewire: error: stream.max_message_bytes: 100000 is over what topic "
        f"{steps} takes (max.message.bytes=50000, less 1024 bytes of record "
        "overhead): set it to at most 48976, or raise the topic's "
        "max.message.bytes"
    ]


def test_an_unreachable_store_whose_url_holds_a_password_is_retried_and_never_logged(
    kafka_bootstrap, scratch_dir
):
    """The worker keeps retrying a store it cannot reach, health fails naming the store,
    and the password written into the URL appears in no log line and no heartbeat."""
    secret = f"s3cret{uuid.uuid4().hex[:8]}"
    settings = settings_for(scratch_dir / "store")
    settings.clickhouse = ClickHouseSettings(
        url=f"http://alice:{secret}@127.0.0.1:{free_port()}", retry_max_s=1.0
    )
    tree = settings.to_dict()
    tree["kafka"]["bootstrap"] = kafka_bootstrap
    config, heartbeat = scratch_dir / "settings.json", scratch_dir / "worker.heartbeat"
    config.write_text(json.dumps(tree))  # the user's own file, as a deployment might hold it
    env = {k: v for k, v in os.environ.items() if not k.startswith("PROBEWIRE_")}
    env.update(PROBEWIRE_CONFIG=str(config), PROBEWIRE_HEARTBEAT_FILE=str(heartbeat))
    with open(scratch_dir / "worker.log", "wb") as log:
        worker = spawn(
            [sys.executable, "-m", "probewire.deploy.cli", "worker", "--loglevel", "info"], log, env
        )
        try:
            check = lambda: subprocess.run(  # noqa: E731
                [
                    sys.executable,
                    "-m",
                    "probewire.deploy.cli",
                    "health",
                    "--component",
                    "worker",
                    "--heartbeat",
                    str(heartbeat),
                ],
                capture_output=True,
                text=True,
                timeout=60,
            )
            deadline = time.monotonic() + 60
            while (result := check()).returncode == 0 or "store" not in result.stderr:
                assert worker.poll() is None, "the worker exited"
                assert time.monotonic() < deadline, result
                time.sleep(0.5)
            assert "cannot connect to http://127.0.0.1:" in result.stderr, result
            assert worker.poll() is None
        finally:
            stop_process(worker)
    written = (scratch_dir / "worker.log").read_text() + heartbeat.read_text() + result.stderr
    assert "probewire: cannot open the store" in written
    assert secret not in written


def test_calibrate_reads_only_the_run_it_names_even_a_hostile_run_id(scratch_dir):
    """The run id is a bound parameter: ``x' OR 1=1 --`` finds no run (not every run). The
    run's ``residual_stats`` and reference ``bpb`` evaluations calibrate the residual
    bounds and the held-out rise (another run's rows, far off, change nothing)."""
    store, cli = scratch_dir / "store", [sys.executable, "-m", "probewire.deploy.cli"]

    def probewire(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)

    assert probewire("migrate", "--store", str(store)).returncode == 0
    rng = np.random.default_rng(12)
    values = ", ".join(
        f"('stable', {s}, {2 + 0.01 * x:.6f}, {1 + 0.01 * y:.6f}, {0.1 + 0.001 * z:.6f})"
        for s, (x, y, z) in enumerate(rng.normal(size=(80, 3)))
    )
    ratios = np.round(np.exp(rng.normal(-1.0, 0.3, size=(20, 4))), 6)  # 20 scan steps
    residual = ", ".join(
        f"('{run}', {4 * t}, '{b // 2}', '{('attn', 'mlp')[b % 2]}', 8, {r * scale}, 1, {r})"
        for run, scale in (("stable", 1), ("other", 1000))
        for t in range(20)
        for b, r in enumerate(ratios[t])
    )
    bpb = np.round(1.2 * np.exp(rng.normal(0, 0.01, 12)), 6)  # flat, noisy: rises and falls
    evaluations = ", ".join(
        f"('{run}', {10 * t}, 'heldout', '{metric}', {v * scale}, '{stream}', {int(stream == 'raw')})"
        for run, metric, stream, scale in (
            ("stable", "bpb", "raw", 1),
            ("stable", "bpb", "ema", 3),  # not the reference weights stream
            ("stable", "nll", "raw", 3),
            ("other", "bpb", "raw", 3),
        )
        for t, v in enumerate(bpb)
        if run == "stable" or t % 2  # the other run jumps up and down
    )
    # the rows go in through the writer, in a process of its own (``sql`` never writes)
    inserted = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, clickhouse_connect; "
            "c = clickhouse_connect.get_client(dsn='chdb://' + sys.argv[1]); "
            "c.command('INSERT INTO probewire.step_metrics "
            "(run_id, step, loss, grad_norm, step_time_s) VALUES ' + sys.argv[2]); "
            "c.command('INSERT INTO probewire.residual_stats (run_id, step, layer, branch, "
            "tokens, ratio, stream_norm, branch_norm) VALUES ' + sys.argv[3]); "
            "c.command('INSERT INTO probewire.evaluations "
            "(run_id, step, suite, metric, value, weights_stream, reference) VALUES ' "
            "+ sys.argv[4])",
            str(store),
            values,
            residual,
            evaluations,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inserted.returncode == 0, inserted.stderr
    stable = probewire("calibrate", "--store", str(store), "--run", "stable", "--window", "20")
    assert stable.returncode == 0, stable.stderr
    block = dict(
        line.strip().split(": ") for line in stable.stdout.split("detectors:\n", 1)[1].splitlines()
    )
    rises = [bpb[i] / np.median(bpb[max(0, i - 5) : i]) - 1 for i in range(3, len(bpb))]
    expected = {
        "residual_ratio_max": 1.5 * np.quantile(ratios.max(axis=1), 0.999),
        "residual_ratio_min": np.quantile(ratios.min(axis=1), 0.001) / 1.5,
        "heldout_bpb_rise": 1.5 * np.quantile(rises, 0.999),
    }
    assert {k: float(block[k]) for k in expected} == {
        k: round(float(v), 3) for k, v in expected.items()
    }
    hostile = probewire(
        "calibrate", "--store", str(store), "--run", "x' OR 1=1 --", "--window", "20"
    )
    assert (hostile.returncode, hostile.stderr) == (
        2,
        'probewire: error: run "x\' OR 1=1 --" has no steps in the store\n',
    )


def test_rank_messages_the_consumer_skipped_are_read_again_and_every_step_is_exact(
    read_store, scratch_dir, monkeypatch
):
    """Tansu, when two producers write to one partition at the same moment (DDP ranks
    ending a step: a step's messages share a partition), can make the later write readable
    first; a consumer then moved past the earlier one (measured with a plain consumer: 1
    record in 6,000 in one run of three). Here the 1st, 3rd, 6th and 7th rank message of
    each partition are dropped as such a consumer drops them; the worker reads the skipped
    offsets again before the next message of their partition (the 1st: past the offset the
    group started from), so every step is stored with every rank, exactly (without the
    reading again, steps are stored without a rank)."""
    monkeypatch.setenv("PROBEWIRE_FAULT_SKIP_RANK_MESSAGES", "1,3,6,7")  # of each partition
    s = LocalStack(
        settings_for(scratch_dir / "store", deadline_s=30.0, max_wait_s=40.0), scratch_dir / "run"
    )
    try:  # a broker of its own: only this run's messages in the partitions
        bootstrap = s.start_broker()
        s.start_worker()
        run = SimRun(run_id=f"skip-{uuid.uuid4().hex[:6]}", world_size=RANKS, seed=9)
        produce(bootstrap, [m for step in range(20) for m in encode(run, step)])
        wait_for(s, run.run_id, 20)
    finally:
        s.stop()
    rows = assert_exact(read_store, scratch_dir / "store", run, list(range(20)))
    assert {r["complete_reason"] for r in rows} == {"all_ranks"}  # none closed without a rank
    log = (scratch_dir / "run" / "worker.log").read_text()
    assert log.count("read again by offset") >= 4, log
