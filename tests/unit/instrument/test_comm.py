"""Collective wrapping in a one-rank gloo world: calls, bytes and exposed wait per op on a
sampled step, nothing on an unsampled one, the originals restored on close."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.wire import decode_rank_step


def test_collectives_issued_by_the_loop_are_counted_and_timed(gloo_world):
    original = dist.all_reduce
    model = torch.nn.Linear(2, 2)
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=RankIdentity(run_id="c", rank=0, world_size=1),
        transport=transport,
        config=ProbeConfig(cadence={"step": 2}, telemetry=False),
    )
    assert dist.all_reduce is not original
    for step in (0, 1, 2):
        with monitor.step(step):
            dist.all_reduce(torch.ones(10))  # 40 bytes
            work = dist.all_reduce(torch.ones(4, dtype=torch.float64), async_op=True)
            work.wait()  # 32 bytes, timed at wait()
            dist.broadcast(torch.zeros(3), src=0)  # 12 bytes
    monitor.close()
    assert dist.all_reduce is original
    records = {r.step: r.values for r in (decode_rank_step(k, v) for k, v in transport.messages)}
    got = records[0]
    assert got[("comm.calls", (("op", "all_reduce"),))] == 2
    assert got[("comm.bytes", (("op", "all_reduce"),))] == 72
    assert got[("comm.calls", (("op", "broadcast"),))] == 1
    assert got[("comm.bytes", (("op", "broadcast"),))] == 12
    assert got[("comm.wait", (("op", "all_reduce"),))] > 0
    assert sorted(records) == [0, 2]  # step 1: the comm tier (every step here: 2) not due
    assert records[2][("comm.calls", (("op", "all_reduce"),))] == 2  # step 1's calls not in it


def _records(transport):
    return {r.step: r.values for r in (decode_rank_step(k, v) for k, v in transport.messages)}


def test_a_wait_the_loop_reports_is_sent_every_step_and_adds_to_the_timed_op(gloo_world):
    """``s.comm_wait``: DDP's all-reduce (timed by the loop's comm hook) on every emitted
    step; calls for one op add up; it adds to the wrappers' wait of the same op, and an op
    the wrappers did not see gets no calls or bytes."""
    transport = MemoryTransport()
    monitor = attach(
        torch.nn.Linear(2, 2),
        None,
        transport=transport,
        identity=RankIdentity(run_id="c", rank=0, world_size=1),
        config=ProbeConfig(cadence={"step": 1, "scan": 2}, telemetry=False),
    )
    for step in range(3):
        with monitor.step(step) as s:
            dist.all_reduce(torch.ones(4))
            s.comm_wait("ddp_allreduce", 0.25)
            s.comm_wait("ddp_allreduce", 0.5 + step)
            s.comm_wait("all_reduce", 100.0)
    monitor.close()
    records = _records(transport)
    ddp, ar = (("op", "ddp_allreduce"),), (("op", "all_reduce"),)
    assert [records[t][("comm.wait", ddp)] for t in range(3)] == [0.75, 1.75, 2.75]
    assert ("comm.calls", ddp) not in records[0] and ("comm.bytes", ddp) not in records[0]
    assert 100.0 < records[0][("comm.wait", ar)] < 101.0  # + the wrapper's timed wait
    assert records[0][("comm.calls", ar)] == 1
    assert 100.0 < records[1][("comm.wait", ar)] < 101.0 and records[1][("comm.calls", ar)] == 1


def test_a_reported_wait_is_checked_and_never_leaks_into_another_step():
    from probewire.instrument import NullStepContext

    transport = MemoryTransport()
    monitor = attach(
        torch.nn.Linear(2, 2),
        None,
        transport=transport,
        identity=RankIdentity(run_id="c", rank=0, world_size=1),
        config=ProbeConfig(cadence={"step": 2, "scan": 0}, telemetry=False, comm=False),
    )
    for step in range(3):
        with monitor.step(step) as s:  # step 1 is not sampled: no record at all
            s.comm_wait("ddp_allreduce", 1.0 + step)
    with monitor.step(3) as s:
        for ctx in (s, NullStepContext()):
            for op, seconds in (
                ("ddp_allreduce", -0.1),
                ("ddp_allreduce", float("nan")),
                ("ddp_allreduce", float("inf")),
                ("ddp_allreduce", True),
                ("ddp_allreduce", torch.tensor(1.0)),
                ("", 1.0),
                ("op=x", 1.0),
                ("a|b", 1.0),
                (3, 1.0),
            ):
                with pytest.raises(ValueError, match="comm_wait"):
                    ctx.comm_wait(op, seconds)
        NullStepContext().comm_wait("ddp_allreduce", 0.5)
    monitor.close()
    records = _records(transport)
    ddp = ("comm.wait", (("op", "ddp_allreduce"),))
    assert sorted(records) == [0, 2]
    assert (records[0][ddp], records[2][ddp]) == (1.0, 3.0)
