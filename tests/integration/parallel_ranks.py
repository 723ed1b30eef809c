"""Ranks of the layout tests: a small model trained on real torch.distributed process groups
(gloo, CPU) under one layout — FSDP2, HSDP, 2 DP × 2 TP with sequence parallelism, two
pipeline stages, two-way expert parallelism (contiguous or strided placement) — with
probewire attached as a user would.

``train(rank, world, port, layout, run_id, bootstrap, trace_dir)`` is the function each
process runs (``torch.multiprocessing.spawn``). Each rank writes what it computed itself to
``trace_dir/rank<r>.jsonl``: its valid-token loss sum and count (where the loss is
computed) and the global gradient norm it clipped with, so the test can hold the stored
values against the ranks' own numbers and against an unsharded float64 reference
(``reference``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

V, D, H, T, B, E, K = 32, 16, 32, 8, 8, 4, 2  # vocab, width, hidden, seq, batch, experts, top-k
IGNORE = -100
STEPS = 2
WORLD = {"fsdp2": 2, "fsdp4": 4, "hsdp": 4, "dp_tp_sp": 4, "pp": 2, "ep": 2}
# "clip": fsdp2 clipped by ``s.clip_grad_norm_(params, CLIP_MAX_NORM)`` with no
# ProbeConfig.clip_threshold, its loss scaled so that G2 falls on both sides of 0.5 (and
# under the stream's default c = 1.0), for CLIP_STEPS steps
# "ep_strided": "ep" with the experts placed round-robin (rank r holds r, r + 2, ...)
# "audit_fsdp2" / "audit_local": fsdp2 whose loop computes the norm it clips with itself and
# reports it (``s.clipped``): the global norm (``get_total_norm`` of the DTensor gradients,
# ``full_tensor()``), or a wrong one, only its local shard's (the grad-norm audit's fault)
RUNS = {**WORLD, "clip": 2, "ep_strided": 2, "audit_fsdp2": 2, "audit_local": 2}
CLIP_MAX_NORM, CLIP_LOSS_SCALE, CLIP_STEPS = 0.5, 0.6, 8


def steps_of(layout: str) -> int:
    return CLIP_STEPS if layout == "clip" else STEPS


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, H), nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Router(nn.Module):
    """Top-k router: (logits, weights, expert ids), as probewire's router probe reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k = K
        self.weight = nn.Parameter(torch.randn(E, D) * 0.5)

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight)
        ids = logits.detach().topk(K, dim=-1).indices
        return logits, torch.softmax(logits.gather(-1, ids), dim=-1), ids


class MoE(nn.Module):
    """E experts, ``E // ep`` of them on this expert-parallel rank: global ids ep·E/ep + j
    (contiguous) or ep + j·ep_size (``strided``), listed as Megatron-core lists them
    (``local_expert_indices``). Tokens of every rank reach every expert through an
    all_gather; the partial outputs of each rank's experts are summed with an all_reduce
    (autograd through both)."""

    def __init__(self, ep_rank: int = 0, ep_size: int = 1, strided: bool = False) -> None:
        super().__init__()
        self.router = Router()
        self.ep_rank, self.ep_size = ep_rank, ep_size
        n = E // ep_size
        self.experts = nn.ModuleList(Expert() for _ in range(n))
        self.local_expert_indices = [
            ep_rank + j * ep_size if strided else ep_rank * n + j for j in range(n)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, D)
        _, weights, ids = self.router(x)
        if self.ep_size > 1:
            from torch.distributed.nn.functional import all_gather, all_reduce

            xs, ws = torch.cat(all_gather(x)), torch.cat(all_gather(weights))
            ids_all = [torch.empty_like(ids) for _ in range(self.ep_size)]
            dist.all_gather(ids_all, ids)
            ids_all = torch.cat(ids_all)
        else:
            xs, ws, ids_all = x, weights, ids
        out = torch.zeros_like(xs)
        for expert_id, expert in zip(self.local_expert_indices, self.experts):
            chosen = ids_all == expert_id  # [N, K]
            gate = (ws * chosen).sum(-1, keepdim=True)  # 0 where not chosen
            out = out + gate * expert(xs)
        if self.ep_size > 1:
            from torch.distributed.nn.functional import all_reduce

            out = all_reduce(out)
            n = x.shape[0]
            out = out[self.ep_rank * n : (self.ep_rank + 1) * n]
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, moe: bool = False, ep_rank: int = 0, ep_size: int = 1, strided=False):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = MoE(ep_rank, ep_size, strided) if moe else Expert()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, moe: bool = False, ep_rank: int = 0, ep_size: int = 1, strided=False):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(
            Block(moe and i == 1, ep_rank, ep_size, strided) for i in range(2)
        )
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def full_model(moe: bool = False) -> Model:
    """The unsharded model every layout starts from (same seed on every rank)."""
    torch.manual_seed(1234)
    return Model(moe)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] tokens and targets; rows padded to random lengths (uneven valid counts)."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 1  # one nearly empty row
    targets[torch.arange(T)[None, :] >= lengths[:, None]] = IGNORE
    return tokens, targets


def shard_rows(step: int, index: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = global_batch(step)
    rows = B // count
    return tokens[index * rows : (index + 1) * rows], targets[index * rows : (index + 1) * rows]


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE, reduction="none"
    ).view_as(targets)


# ------------------------------------------------------------------ layouts
def _fsdp(model: Model, mesh) -> Model:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _tp(model: Model, tp_mesh) -> Model:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.blocks)):
        plan |= {
            f"blocks.{i}.norm": SequenceParallel(),
            f"blocks.{i}.mlp.up": ColwiseParallel(input_layouts=Shard(1)),
            f"blocks.{i}.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
    return parallelize_module(model, tp_mesh, plan)


def _expert_parallel(ep_rank: int, strided: bool = False) -> Model:
    """This rank's part of the MoE model: dense weights as in ``full_model``, and its
    experts (``MoE.local_expert_indices``) of the full MoE layer."""
    full = full_model(moe=True)
    model = Model(moe=True, ep_rank=ep_rank, ep_size=2, strided=strided)
    state = {k: v for k, v in full.state_dict().items() if ".experts." not in k}
    model.load_state_dict(state, strict=False)
    moe = model.blocks[1].mlp
    for expert_id, expert in zip(moe.local_expert_indices, moe.experts):
        expert.load_state_dict(full.blocks[1].mlp.experts[expert_id].state_dict())
    return model


# ------------------------------------------------------------------ one rank
def train(
    rank: int, world: int, port: int, layout: str, run_id: str, bootstrap: str, trace_dir: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from probewire.instrument import KafkaTransport, ProbeConfig, RankIdentity

    identity = RankIdentity(run_id=run_id, rank=rank, world_size=world)
    config = ProbeConfig(
        clip_threshold=1.0, telemetry=False, comm=False, cadence={"step": 1, "scan": 0, "demand": 0}
    )
    transport = KafkaTransport({"bootstrap.servers": bootstrap}, "otlp_metrics")
    trace = open(Path(trace_dir) / f"rank{rank}.jsonl", "w")
    if layout == "clip":
        config = dataclasses.replace(config, clip_threshold=None)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model, data = _fsdp(full_model(), mesh), (mesh.get_local_rank(0), world)
        clip = (CLIP_MAX_NORM, CLIP_LOSS_SCALE, CLIP_STEPS)
        _train_data_parallel(model, mesh, data, identity, config, transport, trace, clip)
    elif layout in ("audit_fsdp2", "audit_local"):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model, data = _fsdp(full_model(), mesh), (mesh.get_local_rank(0), world)
        norm = "local" if layout == "audit_local" else "global"
        _train_data_parallel(model, mesh, data, identity, config, transport, trace, norm=norm)
    elif layout == "pp":
        _train_pipeline(rank, identity, config, transport, trace)
    elif layout in ("ep", "ep_strided"):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        model = _expert_parallel(rank, strided=layout == "ep_strided")
        _train_expert_parallel(model, mesh, identity, config, transport, trace)
    else:
        if layout in ("fsdp2", "fsdp4"):
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            model, data = _fsdp(full_model(), mesh), (mesh.get_local_rank(0), world)
        elif layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
            model = _fsdp(full_model(), mesh)
            data = (mesh.get_local_rank(0) * 2 + mesh.get_local_rank(1), 4)
        else:  # dp_tp_sp
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            model = _fsdp(_tp(full_model(), mesh["tp"]), mesh["dp"])
            data = (mesh.get_local_rank(0), 2)
        _train_data_parallel(model, mesh, data, identity, config, transport, trace)
    trace.close()
    dist.destroy_process_group()


def _close(monitor, transport, trace) -> None:
    """Close the monitor; its send counts go beside the trace (``rank<r>.stats.json``), for
    the test to show when a step is stored without this rank."""
    monitor.close()
    stats = {**monitor.stats, "delivery_failed": transport.failed}
    Path(trace.name).with_suffix(".stats.json").write_text(json.dumps(stats))


def _write(trace, step: int, **values: float) -> None:
    trace.write(json.dumps({"step": step, **values}) + "\n")
    trace.flush()


def _train_data_parallel(
    model, mesh, data, identity, config, transport, trace, clip=(1.0, 1.0, STEPS), norm=None
) -> None:
    """``clip``: (max_norm, a factor on the loss, steps); ``norm``: None clips through
    ``s.clip_grad_norm_``, "global" / "local" with the loop's own norm (``_own_norm``)."""
    from probewire.instrument import attach

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = attach(model, opt, identity=identity, config=config, transport=transport, mesh=mesh)
    index, count = data
    max_norm, loss_scale, steps = clip
    for step in range(steps):
        tokens, targets = shard_rows(step, index, count)
        n_global = int((global_batch(step)[1] != IGNORE).sum())
        with monitor.step(step) as s:
            s.micro_batch(tokens=tokens, mask=targets != IGNORE)
            losses = token_losses(model(tokens), targets)
            s.loss(losses)
            # FSDP averages over dp: undo it
            (losses.sum() * count / n_global * loss_scale).backward()
            if norm is None:
                total = s.clip_grad_norm_(model.parameters(), max_norm)
            else:
                s.gradients()  # G2 is measured here, before the loop's own clip
                total = _own_norm(model, norm, max_norm)
                s.clipped(total, max_norm=max_norm)
            opt.step()
            opt.zero_grad()
        _write(
            trace,
            step,
            loss_sum=float(losses.detach().double().sum()),
            tokens=int((targets != IGNORE).sum()),
            clip_norm=float(total),
        )
    _close(monitor, transport, trace)


def _own_norm(model, norm: str, max_norm: float) -> torch.Tensor:
    """The loop's own clipping norm over FSDP2's DTensor gradients, applied by hand: the
    global one (the shards' norms combined, ``full_tensor()``), or, the bug, only this rank's
    local shard's."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if norm == "local":
        total = torch.nn.utils.get_total_norm([g.to_local() for g in grads])
    else:
        total = torch.nn.utils.get_total_norm(grads).full_tensor()
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for g in grads:
        g.mul_(coef)
    return total


def _train_expert_parallel(model, mesh, identity, config, transport, trace) -> None:
    from probewire.instrument import attach

    rank = model.blocks[1].mlp.ep_rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = attach(model, opt, identity=identity, config=config, transport=transport, mesh=mesh)
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    for step in range(STEPS):
        tokens, targets = shard_rows(step, rank, 2)
        n_global = int((global_batch(step)[1] != IGNORE).sum())
        with monitor.step(step) as s:
            s.micro_batch(tokens=tokens, mask=targets != IGNORE)
            losses = token_losses(model(tokens), targets)
            s.loss(losses)
            (losses.sum() / n_global).backward()
            for p in dense:  # dense weights are data-parallel replicas: sum their gradients
                dist.all_reduce(p.grad)
            local_sq = sum(
                float(p.grad.double().square().sum())
                for n, p in model.named_parameters()
                if ".experts." in n
            )
            owned = torch.tensor([local_sq], dtype=torch.float64)
            dist.all_reduce(owned)
            total_sq = owned.item() + sum(float(p.grad.double().square().sum()) for p in dense)
            s.gradients()
            total = torch.tensor(total_sq**0.5)
            torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 1.0, total)
            s.clipped(total)
            opt.step()
            opt.zero_grad()
        _write(
            trace,
            step,
            loss_sum=float(losses.detach().double().sum()),
            tokens=int((targets != IGNORE).sum()),
            clip_norm=float(total),
        )
    _close(monitor, transport, trace)


def _train_pipeline(rank, identity, config, transport, trace) -> None:
    """Two stages (embed + block 0 | block 1 + norm + head), GPipe over 2 micro-batches; the
    loss exists on the last stage only; the clip norm is all-reduced across the stages."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from probewire.instrument import attach

    full = full_model()

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.blocks = full.embed, nn.ModuleList([full.blocks[0]])

        def forward(self, tokens):
            return self.blocks[0](self.embed(tokens))

    class Last(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Identity(), full.blocks[1]])
            self.norm, self.head = full.norm, full.head

        def forward(self, x):
            return self.head(self.norm(self.blocks[1](x)))

    module = First() if rank == 0 else Last()
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    current: dict[str, object] = {}

    def loss_fn(logits, target):
        losses = token_losses(logits, target)
        if current:  # not in the warm-up step
            current["s"].loss(losses, mask=target != IGNORE)  # type: ignore[attr-defined]
            current["sums"].append(losses.detach().double().sum())  # type: ignore[attr-defined]
        return losses.sum() / current.get("n", 1)  # type: ignore[operator]

    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn, scale_grads=False)
    # a warm-up step before attaching: the stage infers its shapes at its first step with
    # an extra forward whose output also reaches loss_fn (measured on torch 2.13: three
    # loss_fn calls for two micro-batches), which must not be recorded as a micro-batch
    tokens, targets = global_batch(0)
    schedule.step(tokens) if rank == 0 else schedule.step(target=targets)
    module.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    monitor = attach(
        module,
        opt,
        config=config,
        transport=transport,
        identity=RankIdentity_with(identity, {"pp": rank}),
    )
    for step in range(STEPS):
        tokens, targets = global_batch(step)
        n_global = int((targets != IGNORE).sum())
        with monitor.step(step) as s:
            sums: list[torch.Tensor] = []
            current.update(s=s, sums=sums, n=n_global)
            if rank == 0:
                s.micro_batch(tokens=tokens)
                schedule.step(tokens)
            else:
                schedule.step(target=targets)
            s.gradients()
            local = torch.tensor(
                [
                    sum(
                        float(p.grad.double().square().sum())
                        for p in module.parameters()
                        if p.grad is not None
                    )
                ],
                dtype=torch.float64,
            )
            dist.all_reduce(local)
            total = local.sqrt().float().reshape(())
            torch.nn.utils.clip_grads_with_norm_(list(module.parameters()), 1.0, total)
            s.clipped(total)
            opt.step()
            opt.zero_grad()
        last = {"loss_sum": float(sum(sums)), "tokens": n_global} if rank == 1 else {}
        _write(trace, step, clip_norm=float(total), **last)
    _close(monitor, transport, trace)


def RankIdentity_with(identity, coords):  # noqa: N802 - a small constructor helper
    return dataclasses.replace(identity, coords=coords)


# ------------------------------------------------------------------ the reference
def reference(layout: str, step: int = 0) -> dict[str, object]:
    """The unsharded model on the whole global batch, float64 loss: L, the per-rank means
    L_max is taken over, G2 as clip_grad_norm_ gives it, gradient elements, max |g|, and
    (MoE) the per-expert valid-token counts."""
    moe = layout == "ep"
    model = full_model(moe=moe)
    tokens, targets = global_batch(step)
    n_global = int((targets != IGNORE).sum())
    counts = torch.zeros(E, dtype=torch.int64)
    if moe:
        router = model.blocks[1].mlp.router

        def count(module, args, out) -> None:
            chosen = out[2][(targets != IGNORE).reshape(-1)].reshape(-1)
            counts.add_(torch.bincount(chosen, minlength=E))

        router.register_forward_hook(count)
    losses = token_losses(model(tokens), targets)
    (losses.sum() / n_global).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    loss64 = losses.detach().double()
    valid = targets != IGNORE
    shards = {"fsdp2": 2, "fsdp4": 4, "hsdp": 4, "dp_tp_sp": 2, "pp": 1, "ep": 2}[layout]
    rows = B // shards
    means = [
        float(loss64[i * rows : (i + 1) * rows].sum() / valid[i * rows : (i + 1) * rows].sum())
        for i in range(shards)
        if valid[i * rows : (i + 1) * rows].any()
    ]
    return {
        "loss": float(loss64.sum() / n_global),
        "worst": max(means),
        "grad_norm": float(torch.nn.utils.get_total_norm(grads, 2.0)),
        "elements": sum(g.numel() for g in grads),
        "abs_max": max(float(g.abs().max()) for g in grads),
        "expert_counts": counts.tolist(),
    }


def refused(rank: int, world: int, port: int, case: str, out_dir: str) -> None:
    """Attach with a hand declaration the model contradicts; write the error (or "none")."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
    from probewire.instrument.parallel import LayoutError

    model, mesh = full_model(), None
    if case == "plain_shard":  # a ZeRO-style shard of the head, each rank its own rows
        with torch.no_grad():
            model.head.weight.mul_(rank + 1)
    else:  # "fsdp": DTensor shards over dp, declared DDP replicas
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        model = _fsdp(model, mesh)
    try:
        attach(
            model,
            identity=RankIdentity(run_id="refuse", rank=rank, world_size=world),
            config=ProbeConfig(dp_replicated=True, telemetry=False, comm=False),
            transport=MemoryTransport(),
            mesh=mesh,
        ).close()
        message = "none"
    except LayoutError as exc:
        message = str(exc)
    (Path(out_dir) / f"rank{rank}.txt").write_text(message)
    dist.destroy_process_group()
