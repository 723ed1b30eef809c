"""Collective wrapping in a one-rank gloo world: calls, bytes and exposed wait per op on a
sampled step, nothing on an unsampled one, the originals restored on close."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.stream.decode import decode_rank_step


@pytest.fixture()
def gloo_world():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_collectives_issued_by_the_loop_are_counted_and_timed(gloo_world):
    original = dist.all_reduce
    model = torch.nn.Linear(2, 2)
    transport = MemoryTransport()
    monitor = attach(model, None, identity=RankIdentity(run_id="c", rank=0, world_size=1),
                     transport=transport,
                     config=ProbeConfig(cadence={"P1": 2}, telemetry=False))
    assert dist.all_reduce is not original
    for step in (0, 1):
        with monitor.step(step):
            dist.all_reduce(torch.ones(10))                       # 40 bytes
            work = dist.all_reduce(torch.ones(4, dtype=torch.float64), async_op=True)
            work.wait()                                           # 32 bytes, timed at wait()
            dist.broadcast(torch.zeros(3), src=0)                 # 12 bytes
    monitor.close()
    assert dist.all_reduce is original
    records = {r.step: r.values for r in (decode_rank_step(k, v) for k, v in transport.messages)}
    got = records[0]
    assert got[("comm.calls", (("op", "all_reduce"),))] == 2
    assert got[("comm.bytes", (("op", "all_reduce"),))] == 72
    assert got[("comm.calls", (("op", "broadcast"),))] == 1
    assert got[("comm.bytes", (("op", "broadcast"),))] == 12
    assert got[("comm.wait_s", (("op", "all_reduce"),))] > 0
    assert not any(name.startswith("comm.") for name, _ in records[1])  # P1 not sampled
