"""Simulated 2 data-parallel × 2 tensor-parallel ranks in one process.

Each rank's module holds its shard of a Megatron-style MLP (column-parallel W1,
row-parallel W2) plus a LayerNorm whose weight is replicated on both tensor-parallel
ranks. One monitor per rank sends what a real rank would send; the stream's
``reduce_step`` must give the single-process loss and gradient norm.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.wire import decode_rank_step
from probewire.stream.reduce import reduce_step

D, H, V, T = 8, 12, 10, 6


class Full(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, V, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(self.ln(x))))


class Shard(nn.Module):
    """Rank (dp, tp): rows tp of W1, columns tp of W2; ``ln`` is the replica's shared one."""

    def __init__(self, full: Full, ln: nn.LayerNorm, tp: int) -> None:
        super().__init__()
        half = H // 2
        self.ln = ln
        self.up = nn.Linear(D, half, bias=False)
        self.down = nn.Linear(half, V, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(full.up.weight[tp * half : (tp + 1) * half])
            self.down.weight.copy_(full.down.weight[:, tp * half : (tp + 1) * half])

    def partial(self, x):
        return self.down(F.gelu(self.up(self.ln(x))))


def data(dp: int):
    g = torch.Generator().manual_seed(100 + dp)
    x = torch.randn(3, T, D, generator=g)
    targets = torch.randint(0, V, (3, T), generator=g)
    if dp == 0:
        targets[:, 4:] = -100  # uneven valid-token counts across data-parallel ranks
    return x, targets


def losses_of(logits, targets):
    return F.cross_entropy(
        logits.reshape(-1, V), targets.reshape(-1), ignore_index=-100, reduction="none"
    ).view_as(targets)


def reference():
    """Single process: the same model and both data shards; DDP averages replica gradients."""
    torch.manual_seed(0)
    full = Full()
    total, count = 0.0, 0
    for dp in (0, 1):
        x, targets = data(dp)
        losses = losses_of(full(x), targets)
        valid = targets != -100
        total += float(losses.detach().double()[valid].sum())
        count += int(valid.sum())
        (losses.sum() / valid.sum() / 2).backward()
    g2 = sum(float((p.grad.double() ** 2).sum()) for p in full.parameters())
    return total / count, g2, full


def test_reduced_loss_and_gradient_norm_equal_the_single_process_values():
    expected_loss, expected_g2, _ = reference()
    torch.manual_seed(0)
    full = Full()
    config = ProbeConfig(
        tp_replicated=(r"ln(\..*)?",),
        cadence={"scan": 1},
        telemetry=False,
        comm=False,
        clip_threshold=1.0,
    )
    shards, monitors, transports = {}, {}, {}
    for dp in (0, 1):
        ln = nn.LayerNorm(D)
        ln.load_state_dict(full.ln.state_dict())
        for tp in (0, 1):
            rank = 2 * dp + tp
            shards[dp, tp] = Shard(full, ln, tp)
            transports[rank] = MemoryTransport()
            monitors[dp, tp] = attach(
                shards[dp, tp],
                None,
                config=config,
                transport=transports[rank],
                identity=RankIdentity(
                    run_id="L", rank=rank, world_size=4, coords={"dp": dp, "tp": tp}
                ),
            )
    contexts = {k: m.step(0) for k, m in monitors.items()}
    for ctx in contexts.values():
        ctx.__enter__()
    for dp in (0, 1):
        x, targets = data(dp)
        mask = targets != -100
        # the tensor-parallel all-reduce of the row-parallel output, done by autograd here
        logits = shards[dp, 0].partial(x) + shards[dp, 1].partial(x)
        losses = losses_of(logits, targets)
        for tp in (0, 1):  # every tensor-parallel rank holds the same loss
            contexts[dp, tp].micro_batch(mask=mask)
            contexts[dp, tp].loss(losses)
        (losses.sum() / mask.sum() / 2).backward()
    # the data-parallel all-reduce: average the shards' gradients over the two replicas
    done = set()
    for tp in (0, 1):
        for a, b in zip(shards[0, tp].parameters(), shards[1, tp].parameters()):
            if id(a) in done:
                continue  # the LayerNorm is shared by both tensor-parallel shards of a replica
            done.add(id(a))
            mean = a.grad + b.grad  # each replica's objective already carries the 1/2
            a.grad, b.grad = mean.clone(), mean.clone()
    for ctx in contexts.values():
        ctx.gradients()
        ctx.__exit__(None, None, None)
    records = []
    for monitor in monitors.values():
        monitor.close()
    for transport in transports.values():
        records += [decode_rank_step(k, v) for k, v in transport.messages]
    reduced = reduce_step("L", 0, 4, records, "all_ranks").reduced
    loss = reduced[("loss.sum", ())] / reduced[("loss.tokens", ())]
    assert loss == pytest.approx(expected_loss, rel=1e-6)  # float32 shard sums round differently
    assert reduced[("grad.norm_sq", ())] == pytest.approx(expected_g2, rel=1e-5)
    elements = sum(p.numel() for p in full.parameters())
    assert reduced[("grad.elements", ())] == elements  # the LayerNorm counted once
    # the tensor statistics of a sharded weight sum its shards; the replicated one counts once
    ln_n = reduced[("tensor.n", (("kind", "grad"), ("tensor", "ln.weight")))]
    up_n = reduced[("tensor.n", (("kind", "grad"), ("tensor", "up.weight")))]
    assert (ln_n, up_n) == (D, D * H)
    assert math.isclose(
        reduced[("tensor.sum_sq", (("kind", "grad"), ("tensor", "up.weight")))],
        float(
            (
                torch.cat([shards[0, 0].up.weight.grad, shards[0, 1].up.weight.grad]).double() ** 2
            ).sum()
        ),
        rel_tol=1e-6,
    )


def test_a_replicated_parameter_is_reported_by_tensor_parallel_rank_0_only():
    torch.manual_seed(0)
    full = Full()
    ln = nn.LayerNorm(D)
    seen = {}
    for tp in (0, 1):
        transport = MemoryTransport()
        shard = Shard(full, ln, tp)
        monitor = attach(
            shard,
            None,
            transport=transport,
            identity=RankIdentity(run_id="L", rank=tp, world_size=2, coords={"dp": 0, "tp": tp}),
            config=ProbeConfig(
                tp_replicated=(r"ln(\..*)?",),
                cadence={"scan": 1},
                module_names=("ln", "up"),
                telemetry=False,
                comm=False,
            ),
        )
        x, targets = data(0)
        with monitor.step(0) as s:
            s.micro_batch(mask=targets != -100)
            shard.partial(x).sum().backward()
            s.gradients()
        monitor.close()
        [record] = [decode_rank_step(k, v) for k, v in transport.messages]
        seen[tp] = {dict(labels)["tensor"] for n, labels in record.values if n == "tensor.n"}
    assert "ln.weight" in seen[0] and "ln.weight" not in seen[1]
    assert "ln" in seen[0] and "ln" not in seen[1]  # its activation too
    assert "up.weight" in seen[0] and "up.weight" in seen[1]
