"""The evaluator end to end on the real broker: demo checkpoints in, eval records out.

The demo TinyLM trains in-process for 300 steps (a few seconds on CPU) with an EMA of
its weights; checkpoints at steps 25, 100 and 300 are announced on the checkpoints
topic together with a duplicate, a corrupt file, a missing file and a malformed
message. ``--once`` mode scores what is queued and exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from demo_losses import token_loss_sum

from probewire.deploy.demo.data import load_corpus
from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM, save_checkpoint
from probewire.deploy.health import read_heartbeat
from probewire.deploy.settings import KafkaSettings, Settings, StreamSettings, TopicSettings
from probewire.deploy.stack import create_topics
from probewire.evaluators import CheckpointEvent, EvalRecord, EvaluatorOptions, EvaluatorService

pytestmark = pytest.mark.integration

CHECKPOINT_STEPS = (25, 100, 300)
RUN_ID = "eval-e2e"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Checkpoints of a real (tiny) training run: {step: (tokens, path)}, plus the plan."""
    out = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(0)
    model = TinyLM(TinyConfig())
    ema = TinyLM(TinyConfig())
    ema.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    corpus, rng = load_corpus(), np.random.default_rng(0)
    tokens, saved = 0, {}
    for step in range(1, CHECKPOINT_STEPS[-1] + 1):
        batch = corpus.batch(rng, 16, model.cfg.seq_len, min_len=8)
        n_valid = int((batch.targets != IGNORE).sum())
        (token_loss_sum(model(batch.tokens), batch.targets) / n_valid).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), model.parameters(), strict=True):
                p_ema.lerp_(p, 0.1)
        tokens += n_valid
        if step in CHECKPOINT_STEPS:
            path = out / f"step{step}.pt"
            save_checkpoint(model, path, ema=ema)
            saved[step] = (tokens, path)
    return {"checkpoints": saved, "planned": tokens, "dir": out}


def _settings(bootstrap: str) -> Settings:
    tag = uuid.uuid4().hex[:8]
    topics = TopicSettings(
        checkpoints=f"ck-{tag}", evals=f"ev-{tag}", deadletter=f"dl-{tag}", partitions=1
    )
    create_topics(bootstrap, {topics.checkpoints: 1, topics.evals: 1, topics.deadletter: 1})
    return Settings(
        kafka=KafkaSettings(bootstrap=bootstrap),
        topics=topics,
        stream=StreamSettings(app_id=f"pw-{tag}"),
    )


def _publish(bootstrap: str, topic: str, payloads: list[bytes]) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap})
    for payload in payloads:
        producer.produce(topic, key=RUN_ID.encode(), value=payload)
    assert producer.flush(30) == 0


def _read_all(bootstrap: str, topic: str) -> list[tuple[bytes, bytes]]:
    """Every message of partition 0, up to the end-of-partition event (Tansu's watermark
    offsets count record batches, so they cannot say where the partition ends)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"read-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        out: list[tuple[bytes, bytes]] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
                return out
            out.append((msg.key(), msg.value()))
        raise AssertionError(f"no end of {topic} within 30 s ({len(out)} messages read)")
    finally:
        consumer.close()


def _event(step: int, tokens: int, path: Path | str, planned: int, key: bool = False) -> bytes:
    return CheckpointEvent(
        run_id=RUN_ID,
        step=step,
        tokens=tokens,
        flops=6.0 * 1e5 * tokens,
        path=str(path),
        key=key,
        planned_tokens=planned,
    ).to_json()


def test_checkpoints_are_scored_and_bits_per_byte_falls(
    kafka_bootstrap: str, trained: dict, tmp_path: Path
) -> None:
    settings = _settings(kafka_bootstrap)
    ck, planned = trained["checkpoints"], trained["planned"]
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(ck[100][1].read_bytes()[:5000])  # a checkpoint cut short
    t100, t300 = ck[100][0], ck[300][0]
    _publish(
        kafka_bootstrap,
        settings.topics.checkpoints,
        [
            _event(25, *ck[25], planned),
            _event(100, *ck[100], planned),
            _event(100, *ck[100], planned),  # redelivered: skipped
            _event(150, (t100 + t300) // 2, corrupt, planned, key=True),  # dead letter
            _event(200, (t100 + 2 * t300) // 3, tmp_path / "gone.pt", planned, key=True),
            b"{not json",  # dead letter
            _event(300, *ck[300], planned),  # scored after failures
        ],
    )
    service = EvaluatorService(
        settings.evaluator_setup(),
        EvaluatorOptions(
            data_dir=str(tmp_path / "data"), heartbeat_path=tmp_path / "evaluator.heartbeat"
        ),
    )
    stats = service.run(once=True)
    assert (stats.messages, stats.evaluated, stats.skipped, stats.failed) == (7, 3, 1, 3)

    evals = _read_all(kafka_bootstrap, settings.topics.evals)
    assert {key for key, _ in evals} == {RUN_ID.encode()}
    records = [EvalRecord.from_json(value) for _, value in evals]
    assert stats.records == len(records) == 3 * 2 * 5  # steps × streams × (nll, ppl, bpb, acc, em)
    bpb = {(r.step, r.weights_stream): r.value for r in records if r.metric == "bpb"}
    assert len(bpb) == 6  # one per (step, stream): the duplicate was not scored again
    for stream in ("raw", "ema"):
        series = [bpb[(step, stream)] for step in CHECKPOINT_STEPS]
        assert series[0] > series[1] > series[2], (stream, series)
    assert bpb[(25, "raw")] < 6.5 and bpb[(300, "ema")] < 4.5  # uniform is log2(257) = 8.006
    assert {(r.weights_stream, r.reference) for r in records} == {("raw", 0), ("ema", 1)}
    assert {r.suite for r in records} == {"heldout", "choice", "generation"}
    for r in records:
        assert r.tokens == ck[r.step][0] and r.flops == 6.0 * 1e5 * r.tokens
        assert r.dataset_version.startswith("sha256:") and r.tokenizer_version == "utf8-bytes/v1"

    dead = [
        json.loads(value) for _, value in _read_all(kafka_bootstrap, settings.topics.deadletter)
    ]
    reasons = sorted(d["reason"] for d in dead)
    assert len(reasons) == 3
    assert reasons[0].startswith(f"cannot load checkpoint {corrupt} (raw weights)")
    assert reasons[1] == f"checkpoint event: not JSON ({reasons[1].split('(', 1)[1]}"
    assert reasons[2] == f"checkpoint not found: {tmp_path / 'gone.pt'}"
    assert read_heartbeat(tmp_path / "evaluator.heartbeat")["status"] == "stopped"


def test_service_stops_cleanly_on_sigterm(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = _settings(kafka_bootstrap)
    config = tmp_path / "settings.json"
    config.write_text(
        json.dumps(
            {
                "kafka": {"bootstrap": kafka_bootstrap},
                "topics": {
                    "checkpoints": settings.topics.checkpoints,
                    "evals": settings.topics.evals,
                    "deadletter": settings.topics.deadletter,
                },
                "stream": {"app_id": settings.stream.app_id},
            }
        )
    )
    heartbeat = tmp_path / "evaluator.heartbeat"
    env = {**os.environ, "PROBEWIRE_HEARTBEAT_FILE": str(heartbeat)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "probewire.deploy.cli",
            "--config",
            str(config),
            "evaluator",
            "--data-dir",
            str(tmp_path / "data"),
            "--suites",
            "heldout",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while (read_heartbeat(heartbeat) or {}).get("status") != "ready":
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "evaluator never became ready"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stdout.read().decode()
        assert read_heartbeat(heartbeat)["status"] == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
