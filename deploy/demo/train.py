"""One data-parallel rank of the demo training run (torch.distributed, gloo, CPU).

Started by ``probewire demo`` once per rank::

    python -m probewire.deploy.demo.train --rank R --world-size W --master-port P \
        --run-id ID --steps N --bootstrap HOST:PORT [--trace DIR] \
        [--save-every K --ckpt-dir DIR]

The rank attaches ``probewire.instrument`` once and marks every optimizer step with the
monitor's step context: loss by data source, the gradient norm after accumulation and
before clipping, output-layer and system probes every step, tensor probes every
``--p1-every`` steps; a control listener can densify or dump. ``--trace`` writes the
values the loop itself sees (valid-token loss sum, tokens, the norm ``clip_grad_norm_``
returned, the step time the monitor measured) to ``DIR/rank<R>.jsonl`` so tests can check
the pipeline independently; its ``comm_wait_s`` is this rank's wait on DDP's gradient
all-reduce (a comm hook times each bucket from launch to completion), so a straggler can
be told from the ranks that wait for it: under synchronous DDP every rank's step time
includes the slowest rank's delay, and step time minus this wait is the rank's own work.
The same wait goes to the stream every step as ``comm.wait{op=ddp_allreduce}``
(``s.comm_wait``), where stage 2 names the straggler by that own time.
``--save-every`` saves a checkpoint on rank 0 and announces
it on ``probewire.checkpoints``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from probewire.deploy.settings import KafkaSettings
from probewire.instrument import ControlListener, KafkaTransport, ProbeConfig, RankIdentity, attach

from .data import SOURCES, load_corpus
from .faults import FaultError, parse_fault
from .model import IGNORE, PRESETS, TinyConfig, TinyLM, mtp_targets, save_checkpoint

__all__ = ["main"]


class AllReduceWaitHook:
    """A DDP comm hook equal to the default all-reduce hook (divide by the world size,
    all-reduce, return the bucket) that also times each bucket's all-reduce, launch to
    completion, on this rank. Under gloo the wait of a rank that arrives early includes
    the time the last rank took to join: ``take()`` returns the step's total and resets."""

    def __init__(self) -> None:
        self._waits: list[float] = []

    def hook(self, state, bucket):  # no annotations: DDP compares them as objects
        tensor = bucket.buffer().div_(dist.get_world_size())
        # the untimed original: the monitor's CommTimer only times Work.wait(), which a
        # comm hook never calls, and would report a misleading zero wait
        all_reduce = getattr(dist.all_reduce, "__probewire_original__", dist.all_reduce)
        start = time.perf_counter()
        fut = all_reduce(tensor, async_op=True).get_future()

        def done(f):
            self._waits.append(time.perf_counter() - start)
            return f.value()[0]

        return fut.then(done)

    def take(self) -> float:
        total = sum(self._waits)
        self._waits = []
        return total


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", default="otlp_metrics")
    p.add_argument("--detail-topic", default="otlp_detail")
    p.add_argument("--control-topic", default="probewire.control")
    p.add_argument("--checkpoint-topic", default="probewire.checkpoints")
    p.add_argument("--trace", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default="tiny",
        help="demo model structure (moe: experts; media: images; full: all)",
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument(
        "--p1-every",
        type=int,
        default=100,
        help="steps between tensor scans (the probes' scan tier)",
    )
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every K steps (0: never)")
    p.add_argument("--ckpt-dir", type=Path, help="where --save-every writes checkpoints")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="NAME[@STEP][:K=V,...]",
        help="inject a real training fault (see probewire.deploy.demo.faults)",
    )
    p.add_argument(
        "--guard-factor",
        type=float,
        default=3.0,
        help="spike guard: replay a step whose loss exceeds this x its running mean",
    )
    args = p.parse_args(argv)
    try:
        args.faults = [parse_fault(text) for text in args.fault]
        for fault in args.faults:
            fault.check_preset(args.preset)
    except FaultError as exc:
        p.error(str(exc))
    if args.save_every and args.ckpt_dir is None:
        p.error("--save-every needs --ckpt-dir")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.master_port}",
        rank=args.rank,
        world_size=args.world_size,
    )
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    cfg = TinyConfig.preset(args.preset)
    # experts a step does not route to, and the MTP heads the loop does not train, get no
    # gradient: DDP must look for unused parameters on every preset but the dense one
    model = DistributedDataParallel(TinyLM(cfg), find_unused_parameters=args.preset != "tiny")
    comm_wait = AllReduceWaitHook()
    model.register_comm_hook(None, comm_wait.hook)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    corpus = load_corpus()
    rng = np.random.default_rng([args.seed, args.rank])  # a different data shard per rank
    monitor = _attach(args, model, opt)
    trace = open(args.trace / f"rank{args.rank}.jsonl", "w") if args.trace else None
    if args.ckpt_dir is not None and args.rank == 0:
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    flops_per_token = model.module.flops_per_token()
    local_tokens, local_flops = 0, 0.0
    running_loss: float | None = None
    try:
        for step in range(args.steps):
            with monitor.step(step) as s:
                for fault in args.faults:
                    fault.on_step_start(step, args.rank, model, opt)
                batches = _batches(args, cfg, corpus, rng, step)
                n_valid = sum(int((b.targets != IGNORE).sum()) for b in batches)
                # a metric of the loop's own (user_metrics): the share of this rank's
                # target positions that padding or ignored labels leave out, mean over ranks
                positions = sum(b.targets.numel() for b in batches)
                s.log("data/pad_fraction", 1.0 - n_valid / max(positions, 1))
                loss_sum = _forward_backward(model, s, batches, n_valid)
                running_loss = _spike_guard(
                    args, model, s, batches, step, loss_sum, n_valid, running_loss
                )
                # this rank's wait on DDP's gradient all-reduce (complete once backward has
                # returned), sent every step: the stream takes it off the rank's step time
                wait_s = comm_wait.take()
                s.comm_wait("ddp_allreduce", wait_s)
                # clip: the monitor measures G2 (accumulated, unscaled, not yet clipped) and
                # the same norm clips, as torch.nn.utils.clip_grad_norm_ would
                total_norm = s.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                # note: host sync point; the step's scalars are read once, here
                loss_value, norm_value = loss_sum.item(), float(total_norm.item())
            for fault in args.faults:
                fault.on_step_end(step, args.rank)
            local_tokens += n_valid
            local_flops += flops_per_token * sum(b.tokens.numel() for b in batches)
            if trace:
                trace.write(
                    json.dumps(
                        {
                            "step": step,
                            "loss_sum": loss_value,
                            "tokens": n_valid,
                            "clip_total_norm": norm_value,
                            "step_time_s": monitor.last_step_time_s,
                            "comm_wait_s": wait_s,
                        }
                    )
                    + "\n"
                )
            if args.save_every and (step + 1) % args.save_every == 0:
                _checkpoint(args, model, monitor, step, local_tokens, local_flops)
    finally:
        monitor.close()
        if trace:
            trace.close()
        dist.destroy_process_group()


def _attach(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    """Attach the monitor once: observation points, optimizer hooks, control listener and
    the Kafka exporters (rank 0 also announces checkpoints)."""
    kafka = KafkaSettings(bootstrap=args.bootstrap).client_config()
    return attach(
        model,
        opt,
        identity=RankIdentity(
            run_id=args.run_id,
            rank=args.rank,
            world_size=args.world_size,
            local_rank=args.rank,
            coords={"dp": args.rank},
        ),
        config=ProbeConfig(
            clip_threshold=args.clip,
            sources=SOURCES,
            cadence={"step": 1, "scan": args.p1_every, "demand": 0},
        ),
        transport=KafkaTransport(kafka, args.topic),
        detail=KafkaTransport(kafka, args.detail_topic),
        control=ControlListener(
            kafka, run_id=args.run_id, rank=args.rank, topic=args.control_topic
        ),
        events=KafkaTransport(kafka, args.checkpoint_topic) if args.rank == 0 else None,
        run_config={
            k: v
            for k, v in vars(args).items()
            if k not in ("faults", "rank", "master_port", "bootstrap", "trace")
        },
    )


def _batches(
    args: argparse.Namespace, cfg: TinyConfig, corpus: Any, rng: np.random.Generator, step: int
) -> list:
    """The step's micro-batches, a few rows each (random valid lengths pad some rows), as
    the faults leave them."""
    batches = [
        corpus.batch(
            rng,
            args.batch_size,
            cfg.seq_len,
            min_len=8,
            media_tiles=cfg.media_tiles,
            image_size=cfg.image_size,
        )
        for _ in range(args.micro_batches)
    ]
    for fault in args.faults:
        batches = [fault.on_batch(step, args.rank, b) for b in batches]
    return batches


def _forward_backward(
    model: DistributedDataParallel, s: Any, batches: list, n_valid: int
) -> torch.Tensor:
    """Forward and backward over the micro-batches (DDP syncs on the last one); the
    objective is this rank's valid-token mean loss. Returns the valid-token loss sum."""
    loss_sum = torch.zeros((), dtype=torch.float64)
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        s.micro_batch(tokens=batch.tokens, mask=batch.targets != IGNORE, source=batch.source)
        with nullcontext() if last else model.no_sync():
            logits, mtp = model(batch.tokens, batch.media, batch.media_mask, return_mtp=True)
            losses = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]),
                batch.targets.reshape(-1),
                ignore_index=IGNORE,
                reduction="none",
            ).view_as(batch.targets)
            s.loss(losses)
            # MTP heads (preset full) train on the targets k places ahead; the monitored
            # loss stays the main head's
            objective = losses.sum() + sum(
                F.cross_entropy(
                    z.float().reshape(-1, z.shape[-1]),
                    mtp_targets(batch.targets, k).reshape(-1),
                    ignore_index=IGNORE,
                    reduction="sum",
                )
                for k, z in enumerate(mtp, 1)
            )
            (objective / max(n_valid, 1)).backward()
        loss_sum += losses.detach().double().sum()
    return loss_sum


def _spike_guard(
    args: argparse.Namespace,
    model: DistributedDataParallel,
    s: Any,
    batches: list,
    step: int,
    loss_sum: torch.Tensor,
    n_valid: int,
    running_loss: float | None,
) -> float:
    """Replay a suspicious step on the same batches (no update) and check that it
    reproduces the loss (a replay that does not points at hardware); the new running loss."""
    mean_loss = loss_sum.item() / max(n_valid, 1)  # note: host sync point
    flaky = any(f.replay_differs(step) for f in args.faults)
    if flaky or (running_loss is not None and mean_loss > args.guard_factor * running_loss):
        replay = _replay_loss(model.module, batches, perturb=flaky)
        s.replayed(reproduced=abs(replay - loss_sum.item()) <= 1e-6 * abs(loss_sum.item()))
    return mean_loss if running_loss is None else 0.95 * running_loss + 0.05 * mean_loss


def _checkpoint(
    args: argparse.Namespace,
    model: DistributedDataParallel,
    monitor: Any,
    step: int,
    local_tokens: int,
    local_flops: float,
) -> None:
    """Every rank joins the one collective (the run's tokens and FLOPs so far); rank 0
    saves the checkpoint and announces it."""
    totals = torch.tensor([float(local_tokens), local_flops], dtype=torch.float64)
    dist.all_reduce(totals)
    if args.rank == 0:
        path = args.ckpt_dir / f"step{step:07d}.pt"
        save_checkpoint(model.module, path)
        monitor.checkpoint(str(path), step, int(totals[0]), float(totals[1]))


def _replay_loss(model: torch.nn.Module, batches: list, perturb: bool) -> float:
    """The step's loss sum recomputed on the same batches without touching the gradients.
    ``perturb`` flips one bit of one weight for the replay (then restores it): what a flaky
    device does to a replay. The bit is the lowest exponent bit of the output weight of
    byte 32 (space, the commonest target), so the weight halves or doubles and the replayed
    loss sum moves past the guard's 1e-6 tolerance; the former low mantissa bit of byte 0's
    weight moved it by less than that, the replay "reproduced" and nothing paged."""
    weight = model.head.weight
    saved = weight.data[32, 0].clone()
    with torch.no_grad():
        if perturb:
            bits = weight.data[32, 0].view(torch.int32)
            bits ^= 1 << 23
        total = sum(
            float(
                F.cross_entropy(
                    model(b.tokens, b.media, b.media_mask).float().transpose(1, 2),
                    b.targets,
                    ignore_index=IGNORE,
                    reduction="sum",
                )
            )
            for b in batches
        )
        weight.data[32, 0] = saved
    return total


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
