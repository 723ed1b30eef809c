"""A data-parallel training script with probewire attached: the README's snippet, runnable.

    probewire run --store ./probewire-data -- torchrun --nproc-per-node 2 examples/train_torchrun.py

Inside ``probewire run`` (or after exporting what ``probewire up`` prints), ``attach`` needs
no transport and no identity: the broker and the run id come from the environment,
rank and world size from torchrun. A tiny byte-level language model trains on random
rows of two data sources, padded so ranks see unequal valid-token counts.

``--trace FILE`` makes rank 0 write, per step, the loss this script computes itself in
float64 (Σ over ranks of the valid-token loss sums / Σ valid tokens, all-reduced) and the
learning rate its update used, and every ``--eval-every`` steps the held-out accuracy the
ranks logged with ``s.log("val_acc", acc)`` as the script averages it itself (a float64
all-reduce over ranks): the tests compare them with what the store holds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from probewire.instrument import ProbeConfig, attach

IGNORE = -100
SOURCES = ("web", "code")


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, an output head named ``lm_head``."""

    def __init__(self, vocab: int = 256, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(2)
        )
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(x)


def batches(rank: int, rows: int = 4, length: int = 16):
    """Random rows per rank; each row has a data source and a random valid length."""
    g = torch.Generator().manual_seed(1000 + rank)
    while True:
        tokens = torch.randint(0, 256, (rows, length), generator=g)
        targets = torch.roll(tokens, -1, dims=1)
        valid = torch.randint(4, length + 1, (rows,), generator=g)
        targets[torch.arange(length)[None, :] >= valid[:, None]] = IGNORE
        source = [SOURCES[int(i)] for i in torch.randint(0, 2, (rows,), generator=g)]
        yield tokens, targets, source


def accuracy(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> float:
    """Top-1 next-token accuracy over the valid targets of a held-out batch (this rank's)."""
    with torch.no_grad():
        hit = (model(tokens).argmax(-1) == targets) & (targets != IGNORE)
    return int(hit.sum()) / int((targets != IGNORE).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--sleep-s", type=float, default=0.0, help="pause per step (to watch live)")
    p.add_argument("--eval-every", type=int, default=10, help="held-out accuracy every N steps")
    p.add_argument("--trace", help="rank 0 writes the script's own loss and lr per step")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # identical initial weights on every rank
    model = DistributedDataParallel(TinyLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    loader = batches(rank)
    held_out = next(batches(rank + 100))[:2]  # this rank's held-out tokens and targets
    trace = open(args.trace, "w") if args.trace and rank == 0 else None

    monitor = attach(
        model,
        optimizer,
        config=ProbeConfig(clip_threshold=1.0, sources=SOURCES),
        run_config={"lr": args.lr, "steps": args.steps, "warmup": 10},
    )
    for step in range(args.steps):
        # a metric of your own, measured outside the step (its forward is not probed)
        acc = accuracy(model, *held_out) if step % args.eval_every == 0 else None
        with monitor.step(step) as s:  # step time includes data loading
            if acc is not None:
                s.log("val_acc", acc)  # one series per name; stored as the mean over ranks
            tokens, targets, source = next(loader)
            s.micro_batch(tokens=tokens, mask=targets != IGNORE, source=source)
            losses = F.cross_entropy(
                model(tokens).transpose(1, 2), targets, ignore_index=IGNORE, reduction="none"
            )
            s.loss(losses)  # loss.sum / loss.tokens per source
            n_valid = (targets != IGNORE).sum()
            (losses.sum() / n_valid).backward()
            s.clip_grad_norm_(model.parameters(), 1.0)  # measures G2, then clips
            lr = optimizer.param_groups[0]["lr"]  # the rate this update uses
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if args.trace:  # the script's own global loss, in float64 (one extra collective)
            totals = torch.stack([losses.detach().double().sum(), n_valid.double()])
            dist.all_reduce(totals)
            row = {"step": step, "loss": (totals[0] / totals[1]).item(), "lr": lr}
            if acc is not None:  # the mean over ranks, as the script computes it
                mean = torch.tensor([acc], dtype=torch.float64)
                dist.all_reduce(mean)
                row["val_acc"] = mean.item() / dist.get_world_size()
            if trace:
                trace.write(json.dumps(row) + "\n")
                trace.flush()
        time.sleep(args.sleep_s)
    monitor.close()  # marks the run finished
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
