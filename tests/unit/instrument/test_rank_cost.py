"""The step tier's cost does not grow with the number of parameter tensors (issue 35): the
torch operations a P0 step launches are the same for 10 and 1,000 tensors (counted with
``torch.profiler``), and the gradients' grouped copy (one ``_chunk_cat`` per group and
dtype) gives the per-group values of a float64 reference, with a non-finite gradient, an
empty and a 0-d parameter, bf16 and float64 gradients among them."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from probewire.instrument import MemoryTransport, NullTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.wire import decode_rank_step

P0 = dict(cadence={"step": 1, "scan": 0, "demand": 0}, telemetry=False, comm=False)
MARK = "test.step"


class Many(torch.nn.Module):
    """``tensors`` small parameters used by one ``stack``: a step of few operations of its
    own, so that the profile of a step of 1,000 tensors stays small."""

    def __init__(self, tensors: int) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(torch.randn(3, 4) for _ in range(tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.stack(list(self.ps)) * x).sin().sum()


def _launched(event: Any) -> bool:
    """An aten:: operation no other aten:: operation called (a launch of its own)."""
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def aten_ops(step) -> np.ndarray:
    """[launched, recorded]: the aten:: operations ``step()`` launched on this thread, and
    all it recorded there (the launched ones' inner calls too)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(MARK):
            step()
    events = prof.events()
    me = next(e.thread for e in events if e.name == MARK)
    mine = [e for e in events if e.thread == me and e.name.startswith("aten::")]
    return np.array([sum(map(_launched, mine)), len(mine)])


def stepper(tensors: int, config: ProbeConfig, helper: bool) -> tuple[Any, Any]:
    """(one training step of a fresh ``Many(tensors)`` under ``config``, its monitor)."""
    torch.manual_seed(0)
    model = Many(tensors)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, foreach=True)
    monitor = attach(
        model,
        opt,
        identity=RankIdentity(run_id="ops", rank=0, world_size=1),
        config=config,
        transport=NullTransport(),
    )
    x = torch.randn(3, 4)
    state = {"step": 0}

    def step() -> None:
        with monitor.step(state["step"]) as s:
            loss = model(x)
            s.loss_totals(loss.detach(), 1)
            loss.backward()
            if helper:
                s.clip_grad_norm_(model.parameters(), 1.0)
            else:  # the loop clips by itself
                s.gradients()
                s.clipped(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad(set_to_none=True)
        state["step"] += 1

    return step, monitor


def p0_ops(tensors: int, helper: bool) -> np.ndarray:
    """[launched, recorded] aten:: operations of a P0 step beyond the same step without
    probewire (each copy warmed up first: plans are made once, on the first steps)."""
    counts = []
    for config in (ProbeConfig(**P0), ProbeConfig(enabled=False)):
        step, monitor = stepper(tensors, config, helper)
        for _ in range(3):
            step()
        counts.append(aten_ops(step))
        monitor.close()
    return counts[0] - counts[1]


@pytest.mark.parametrize("helper", [True, False])
def test_a_p0_step_launches_as_many_torch_ops_for_1000_tensors_as_for_10(caplog, helper):
    """Through ``clip_grad_norm_`` every operation the profiler records, inner calls too;
    where the loop clips by itself the gradient norm is a ``_foreach_norm`` of its own, one
    launch whose CPU fallback calls one norm per tensor (one kernel on CUDA)."""
    caplog.set_level(logging.ERROR)  # these models have no head
    few, many = p0_ops(10, helper), p0_ops(1000, helper)
    assert 0 < few[0] == many[0], (few, many)
    if helper:
        assert few[1] == many[1], (few, many)


class Odd(torch.nn.Module):
    """Parameters the grouped copy must handle: small float32 ones, a 0-d scale, an empty
    tensor, a bf16 and a float64 vector, and one whose gradient gets NaN and -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(20))
        self.scale = torch.nn.Parameter(torch.tensor(0.5))
        self.empty = torch.nn.Parameter(torch.zeros(0, 3))
        self.low = torch.nn.Parameter(torch.randn(5).to(torch.bfloat16))
        self.wide = torch.nn.Parameter(torch.randn(7, dtype=torch.float64))
        self.poisoned = torch.nn.Parameter(torch.randn(4, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = x @ self.poisoned.t() * self.scale + self.empty.sum()
        return x + self.low.float().sum() + self.wide.sum().float()


def group_reference(grads: list[np.ndarray]) -> dict[str, float]:
    a = np.concatenate([g.ravel() for g in grads])
    f = a[np.isfinite(a)]
    return {
        "grad.abs_sum": np.abs(f).sum(),
        "grad.abs_max": np.abs(f).max(initial=0.0),
        "grad.zeros": np.count_nonzero(a == 0),
        "grad.elements": a.size,
        "grad.nonfinite": np.count_nonzero(~np.isfinite(a)),
        "grad.norm_sq": (f * f).sum(),
    }


def test_the_grouped_gradient_copy_gives_the_float64_reference_per_group():
    """P0 only: the small gradients of each (group, dtype) copied by one ``_chunk_cat``
    and reduced on the emitter thread equal the float64 reference of the gradients as they
    were before the clip, non-finite, empty, 0-d, bf16 and float64 ones included."""
    torch.manual_seed(0)
    model = Odd()
    model.poisoned.register_hook(
        lambda g: g.index_fill(0, torch.tensor([1]), float("nan")).index_fill(
            0, torch.tensor([3]), float("-inf")
        )
    )
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=RankIdentity(run_id="grouped", rank=0, world_size=1),
        transport=transport,
        config=ProbeConfig(**P0),
    )
    with monitor.step(0) as s:
        out = model(torch.randn(3, 6))
        s.loss_totals(out.detach().sum(), 3)
        out.sum().backward()
        grads = [p.grad.to(torch.float64, copy=True).numpy() for p in model.parameters()]
        s.clip_grad_norm_(model.parameters(), 1e-3)  # clips in place after the copy
    monitor.close()
    assert model.empty.grad is not None and model.empty.grad.numel() == 0
    [rec] = [decode_rank_step(k, v) for k, v in transport.messages]
    want = group_reference(grads)
    assert want["grad.nonfinite"] == 12 and want["grad.elements"] == 20 * 42 + 1 + 5 + 7 + 24
    for name, expected in want.items():
        if name == "grad.norm_sq":
            continue  # unlabelled: the clipping norm (NaN here); the group's is below
        assert rec.values[(name, ())] == pytest.approx(expected, rel=1e-6), name
    for name, expected in want.items():
        got = rec.values[(name, (("group", "other"),))]
        assert got == pytest.approx(expected, rel=1e-6), name


def test_sharded_gradients_go_through_the_grouped_copy_as_their_local_shards(gloo_world):
    """FSDP2 (``fully_shard`` on a one-rank gloo mesh): DTensor gradients, their local
    shards copied by the grouped path, give the float64 reference of the full gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from probewire.instrument.parallel import is_dtensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(8)))
    fully_shard(model, mesh=mesh)
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=RankIdentity(run_id="sharded", rank=0, world_size=1, coords={"dp": 0}),
        transport=transport,
        config=ProbeConfig(**P0),
        mesh=mesh,
    )
    with monitor.step(0) as s:
        out = model(torch.randn(3, 6))
        s.loss_totals(out.detach().sum(), 3)
        out.pow(2).sum().backward()
        assert all(is_dtensor(p.grad) for p in model.parameters())
        grads = [p.grad.full_tensor().to(torch.float64).numpy() for p in model.parameters()]
        s.clip_grad_norm_(model.parameters(), 1e-3)
    monitor.close()
    [rec] = [decode_rank_step(k, v) for k, v in transport.messages]
    for name, expected in group_reference(grads).items():
        got = rec.values[(name, (("group", "other"),))]
        assert got == pytest.approx(expected, rel=1e-6), name
