"""The ring buffer of unsent scan-tier detail (``ProbeConfig.ring_every``): held steps send
their step-tier points only, a dump sends the held detail of the last ``ring_steps`` steps
once (marked replay), with the values a dense run sends; the ring's memory is bounded."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from probewire.deploy.demo.data import SOURCES, load_corpus
from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, Point, ProbeConfig, RankIdentity, attach
from probewire.instrument.catalog import CATALOG, Loss, Tensor, Tier
from probewire.instrument.export import StepEmitter, split_held
from probewire.instrument.wire import decode_rank_step

IDENTITY = RankIdentity(run_id="ring", rank=0, world_size=1, host="h")
SCAN_EVERY, STEPS, RING = 10, 15, 4


def _batches(n: int):
    corpus, rng, cfg = load_corpus(), np.random.default_rng(0), TinyConfig()
    return [corpus.batch(rng, 4, cfg.seq_len, min_len=8) for _ in range(n)]


def _train(config: ProbeConfig, batches) -> tuple:
    torch.manual_seed(0)
    model = TinyLM(TinyConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    transport = MemoryTransport()
    monitor = attach(model, opt, identity=IDENTITY, config=config, transport=transport)
    for step, batch in enumerate(batches):
        with monitor.step(step) as s:
            s.micro_batch(tokens=batch.tokens, mask=batch.targets != IGNORE, source=batch.source)
            losses = F.cross_entropy(
                model(batch.tokens).transpose(1, 2),
                batch.targets,
                ignore_index=IGNORE,
                reduction="none",
            )
            s.loss(losses)
            (losses.sum() / (batch.targets != IGNORE).sum()).backward()
            s.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
    assert monitor._emitter.flush(30)
    return monitor, transport


def _decoded(transport: MemoryTransport, start: int = 0):
    return [decode_rank_step(k, v) for k, v in transport.messages[start:]]


def _tensor_values(record) -> dict:
    return {k: v for k, v in record.values.items() if k[0] in Tensor.ALL}


@pytest.fixture(scope="module")
def runs():
    batches = _batches(STEPS)
    common = dict(clip_threshold=1.0, sources=SOURCES)
    ring, ring_transport = _train(
        ProbeConfig(
            cadence={"step": 1, "scan": SCAN_EVERY}, ring_every=1, ring_steps=RING, **common
        ),
        batches,
    )
    dense, dense_transport = _train(ProbeConfig(cadence={"step": 1, "scan": 1}, **common), batches)
    yield ring, ring_transport, dense_transport
    ring.close()
    dense.close()


def test_held_steps_send_their_step_tier_points_only(runs):
    _, transport, _ = runs
    sent = _decoded(transport)
    assert [r.step for r in sent] == list(range(STEPS)) and not any(r.replay for r in sent)
    for record in sent:
        scan_points = {k[0] for k in record.values if CATALOG[k[0]].tier is Tier.SCAN}
        if record.step % SCAN_EVERY == 0:
            assert Tensor.ABS_MAX in scan_points  # a scan step sends its detail
        else:
            assert not scan_points, record.step  # held: nothing of the scan tier sent
            assert (Loss.SUM, ()) in record.values  # ... and the rest of the step is


def test_a_dump_sends_the_held_detail_of_the_steps_before_once_with_dense_values(runs):
    monitor, transport, dense_transport = runs
    # an anomaly at step 13, between the P1 steps 10 and 20: the stream asks for a dump
    before = len(transport.messages)
    monitor.dump()
    assert monitor._emitter.flush(30)
    replayed = _decoded(transport, before)
    assert [r.step for r in replayed] == list(range(STEPS - RING, STEPS))
    assert all(r.replay for r in replayed) and monitor.stats["replayed"] == RING
    dense = {r.step: r for r in _decoded(dense_transport)}
    for record in replayed:
        assert all(CATALOG[k[0]].tier is Tier.SCAN for k in record.values)
        expected = _tensor_values(dense[record.step])
        assert expected and _tensor_values(record) == expected  # the same measurement
    # a second dump for the same anomaly sends nothing already sent
    monitor.dump()
    assert monitor._emitter.flush(30)
    assert len(transport.messages) == before + RING


def test_split_held_keeps_exactly_the_scan_tier():
    points = [Point(Loss.SUM, 1.0), Point(Tensor.N, 4.0, (("tensor", "x"), ("kind", "fwd")))]
    assert split_held(points) == ([points[0]], [points[1]])


class Counting(MemoryTransport):
    """Counts messages, keeps none (so the ring is what remains)."""

    def send(self, key: bytes, value: bytes) -> bool:
        self.count = getattr(self, "count", 0) + 1
        return True


def test_the_ring_is_bounded_by_ring_steps_and_keeps_no_sent_step():
    transport = Counting()
    emitter = StepEmitter(IDENTITY, transport, ring_steps=8, idle_s=0.001)
    points = [
        Point(Tensor.SUM, float(i), (("tensor", f"t{i}"), ("kind", "grad"))) for i in range(50)
    ] + [Point(Loss.SUM, 1.0), Point(Loss.TOKENS, 2.0)]

    def emit(steps):
        for step in steps:
            emitter.emit(step, points, held=step % 5 != 0)
            if step % 64 == 0:
                assert emitter.flush(30)
        assert emitter.flush(30)

    emit(range(0, 200))
    gc.collect()
    tracemalloc.start()
    try:
        emit(range(200, 400))
        gc.collect()
        first = tracemalloc.get_traced_memory()[0]
        emit(range(400, 2400))
        gc.collect()
        second = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert transport.count == 2400
    kept = [step for step, _ in emitter.ring]
    assert kept == [s for s in range(2390, 2400) if s % 5][-8:]  # the last 8 held steps
    assert all(len(held) == 50 for _, held in emitter.ring)  # scan points only
    # ten times the steps, the same ring: memory does not grow with the steps emitted
    # (one held step of 50 points is ~10 KiB: a growing ring would add ~16 MiB here)
    assert second - first < 64 * 1024, (first, second)
    emitter.close()
