"""Control messages (densify / dump) and checkpoint events: parsing here, the real broker
in the tests marked ``integration`` (the session's ``kafka_bootstrap`` fixture)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import torch

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.evaluators.records import CheckpointEvent
from probewire.instrument import (
    ControlListener,
    KafkaTransport,
    MemoryTransport,
    ProbeConfig,
    RankIdentity,
    attach,
    checkpoint_event,
)
from probewire.instrument.catalog import Tensor
from probewire.instrument.wire import decode_rank_step


def listener(calls: list) -> ControlListener:
    control = ControlListener({"bootstrap.servers": "unused:1"}, run_id="r1", rank=0)
    control._on_densify = lambda steps: calls.append(("densify", steps))
    control._on_dump = lambda: calls.append(("dump",))
    return control


@pytest.mark.parametrize(
    "payload,outcome,call",
    [
        (b'{"run_id": "r1", "action": "densify", "steps": 5}', "densify", ("densify", 5)),
        (b'{"action": "dump"}', "dump", ("dump",)),
        (b'{"run_id": "other", "action": "dump"}', "ignored", None),
        (b'{"run_id": "r1", "action": "densify", "steps": 0}', "error", None),
        (b'{"run_id": "r1", "action": "densify", "steps": true}', "error", None),
        (b'{"run_id": "r1", "action": "explode"}', "error", None),
        (b"not json", "error", None),
        (b"[1, 2]", "error", None),
        (None, "error", None),
    ],
)
def test_control_messages_are_applied_or_rejected_without_raising(payload, outcome, call):
    calls: list = []
    control = listener(calls)
    assert control.handle(payload) == outcome
    assert calls == ([call] if call else [])
    assert (control.handled, control.errors) == ((1, 0) if call else (0, int(outcome == "error")))


def test_checkpoint_event_parses_as_the_evaluators_record():
    body = checkpoint_event(
        run_id="r1",
        path="/c/7.pt",
        step=7,
        tokens=900,
        flops=2.5e9,
        weights_stream="raw",
        key=False,
    )
    event = CheckpointEvent.from_json(body)
    assert (event.run_id, event.step, event.tokens, event.flops, event.path) == (
        "r1",
        7,
        900,
        2.5e9,
        "/c/7.pt",
    )
    for bad in (dict(step=-1), dict(tokens=1.5), dict(flops=float("nan")), dict(path="")):
        with pytest.raises(ValueError):
            checkpoint_event(**{**dict(run_id="r1", path="/p", step=1, tokens=1, flops=1.0), **bad})


def test_a_broken_broker_address_never_reaches_the_loop():
    control = ControlListener(
        {"bootstrap.servers": "127.0.0.1:1"},
        run_id="r1",
        rank=0,
        retry_s=0.05,
        metadata_timeout_s=0.2,
    )
    control.start(lambda steps: None, lambda: None)
    time.sleep(0.5)
    control.close(5.0)
    assert not control.ready.is_set() and control.errors >= 1
    assert not control._thread.is_alive()


def test_close_stops_a_listener_still_waiting_for_a_broker_at_once():
    """No broker answers and the metadata wait is the default 10 s: close stops the thread
    within a fraction of a second, so nothing of it runs on (and logs) after the monitor
    closed."""
    from probewire.deploy.stack import free_port

    port = free_port()  # a loopback port nothing listens on
    control = ControlListener({"bootstrap.servers": f"127.0.0.1:{port}"}, run_id="r1", rank=0)
    control.start(lambda steps: None, lambda: None)
    time.sleep(0.3)  # inside the first metadata request
    started = time.monotonic()
    control.close(5.0)
    assert not control._thread.is_alive() and time.monotonic() - started < 2.0


# ------------------------------------------------------------------ real broker
def produce(bootstrap: str, topic: str, key: bytes, value: bytes) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, key=key, value=value)
    assert producer.flush(10) == 0


def consume_all(bootstrap: str, topic: str, key: bytes, want: int, timeout_s: float = 20.0):
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"t-{uuid.uuid4().hex}",
            "enable.auto.commit": "false",
            "session.timeout.ms": "6000",
        }
    )
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
    found, deadline = [], time.monotonic() + timeout_s
    while len(found) < want and time.monotonic() < deadline:
        message = consumer.poll(0.2)
        if message is not None and message.error() is None and message.key() == key:
            found.append(message.value())
    consumer.close()
    return found


def tiny_step(monitor, model, opt, step):
    tokens = torch.randint(0, 256, (2, 4))
    with monitor.step(step) as s:
        s.micro_batch(tokens=tokens)
        logits = model(tokens)
        losses = torch.nn.functional.cross_entropy(
            logits.reshape(-1, 257), tokens.reshape(-1), reduction="none"
        ).view(2, 4)
        s.loss(losses)
        losses.sum().backward()
        s.gradients()
        opt.step()
        opt.zero_grad()


@pytest.mark.integration
def test_densify_and_dump_over_the_real_control_topic(kafka_bootstrap):
    run_id = f"ctl-{uuid.uuid4().hex[:8]}"
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(seq_len=4, d_model=8, n_layer=1, n_head=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    transport = MemoryTransport()
    control = ControlListener({"bootstrap.servers": kafka_bootstrap}, run_id=run_id, rank=0)
    monitor = attach(
        model,
        opt,
        transport=transport,
        control=control,
        identity=RankIdentity(run_id=run_id, rank=0, world_size=1),
        config=ProbeConfig(
            cadence={"scan": 0}, ring_steps=2, ring_every=1, telemetry=False, comm=False
        ),
    )
    assert control.ready.wait(20), "listener never got its partitions"
    tiny_step(monitor, model, opt, 0)
    produce(
        kafka_bootstrap,
        "probewire.control",
        run_id.encode(),
        json.dumps({"run_id": run_id, "action": "densify", "steps": 2}).encode(),
    )
    deadline = time.monotonic() + 20
    while control.handled < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    for step in (1, 2, 3):
        tiny_step(monitor, model, opt, step)
    produce(
        kafka_bootstrap,
        "probewire.control",
        run_id.encode(),
        json.dumps({"run_id": run_id, "action": "dump"}).encode(),
    )
    deadline = time.monotonic() + 20
    while monitor.stats["replayed"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    monitor.close()
    steps = [decode_rank_step(k, v) for k, v in transport.messages]
    scanned = {(r.step, r.replay) for r in steps if any(n == Tensor.N for n, _ in r.values)}
    # densified steps 1, 2 sent their scans; 0 and 3 kept theirs in the ring until the dump
    assert scanned == {(1, False), (2, False), (0, True), (3, True)}
    assert [(r.step, r.replay) for r in steps] == [
        (0, False),
        (1, False),
        (2, False),
        (3, False),
        (0, True),
        (3, True),
    ]


@pytest.mark.integration
def test_rank_0_announces_a_checkpoint_on_the_checkpoints_topic(kafka_bootstrap):
    run_id = f"ckpt-{uuid.uuid4().hex[:8]}"
    model = TinyLM(TinyConfig(seq_len=4, d_model=8, n_layer=1, n_head=2))
    config = {"bootstrap.servers": kafka_bootstrap}
    monitor = attach(
        model,
        None,
        transport=MemoryTransport(),
        events=KafkaTransport(config, "probewire.checkpoints"),
        identity=RankIdentity(run_id=run_id, rank=0, world_size=2),
        config=ProbeConfig(telemetry=False, comm=False),
    )
    assert monitor.checkpoint("/ckpt/step000099.pt", 99, 51_200, 3.1e12, key=True)
    monitor.close()
    [body] = consume_all(kafka_bootstrap, "probewire.checkpoints", run_id.encode(), 1)
    event = CheckpointEvent.from_json(body)
    assert (
        event.run_id,
        event.step,
        event.tokens,
        event.flops,
        event.path,
        event.key,
        event.weights_stream,
    ) == (run_id, 99, 51_200, 3.1e12, "/ckpt/step000099.pt", True, "raw")
