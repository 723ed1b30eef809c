"""One data-parallel rank of the demo training run (torch.distributed, gloo, CPU).

Started by ``probewire demo`` once per rank::

    python -m probewire.deploy.demo.train --rank R --world-size W --master-port P \
        --run-id ID --steps N --bootstrap HOST:PORT [--trace DIR]

Per step each rank emits its valid-token loss sum and count, its step time, and the
squared global gradient norm of its replica (after accumulation and unscaling, before
clipping). ``--trace`` writes the same values, plus the norm ``clip_grad_norm_``
returned, to ``DIR/rank<R>.jsonl`` so tests can check the pipeline independently.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from probewire.deploy.settings import KafkaSettings
from probewire.instrument.export import KafkaTransport, Point, RankIdentity, StepEmitter

from .data import load_corpus
from .model import TinyConfig, TinyLM, token_loss_sum

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", default="otlp_metrics")
    p.add_argument("--trace", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.master_port}",
                            rank=args.rank, world_size=args.world_size)
    torch.manual_seed(args.seed)  # identical initial weights on every rank
    cfg = TinyConfig()
    model = DistributedDataParallel(TinyLM(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    corpus = load_corpus()
    rng = np.random.default_rng([args.seed, args.rank])  # a different data shard per rank
    emitter = StepEmitter(RankIdentity(run_id=args.run_id, rank=args.rank,
                                       world_size=args.world_size, coords={"dp": args.rank}),
                          KafkaTransport(KafkaSettings(bootstrap=args.bootstrap).client_config(),
                                         args.topic))
    trace = open(args.trace / f"rank{args.rank}.jsonl", "w") if args.trace else None
    try:
        for step in range(args.steps):
            t0 = time.perf_counter()
            # data: a few rows per micro-batch; random valid lengths pad some rows
            batches = [corpus.batch(rng, args.batch_size, cfg.seq_len, min_len=8)
                       for _ in range(args.micro_batches)]
            n_valid = sum(int((b.targets != -100).sum()) for b in batches)
            loss_sum = torch.zeros((), dtype=torch.float64)
            # forward/backward: the objective is this rank's valid-token mean loss
            for i, batch in enumerate(batches):
                last = i == len(batches) - 1
                with nullcontext() if last else model.no_sync():
                    micro = token_loss_sum(model(batch.tokens), batch.targets)
                    (micro / max(n_valid, 1)).backward()
                loss_sum += micro.detach().double()
            # clip: the returned norm is G2 of this replica, measured before clipping
            total_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            # note: host sync point; the step's scalars are read once, here
            loss_value, norm_value = loss_sum.item(), float(total_norm.item())
            step_time = time.perf_counter() - t0
            emitter.emit(step, [Point("loss.sum", loss_value), Point("loss.tokens", n_valid),
                                Point("grad.norm_sq", norm_value * norm_value),
                                Point("step_time_s", step_time)])
            if trace:
                trace.write(json.dumps({"step": step, "loss_sum": loss_value, "tokens": n_valid,
                                        "clip_total_norm": norm_value,
                                        "step_time_s": step_time}) + "\n")
    finally:
        emitter.close()
        if trace:
            trace.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
