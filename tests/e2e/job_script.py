"""A one-rank training script for the job-state tests: ``attach`` with no transport (the
environment ``probewire run`` / ``up`` exports), ``--steps`` steps of a linear model, an
optional pause (a checkpoint save longer than the configured silence) and an optional
exit without closing the monitor (a launcher that fails; no rank says anything)."""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from probewire.instrument import attach


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sleep-s", type=float, default=0.1)
    p.add_argument("--pause-at", type=int, default=-1, help="pause after this step")
    p.add_argument("--pause-s", type=float, default=0.0)
    p.add_argument("--exit-code", type=int, default=0, help="non-zero: exit without close()")
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    started = time.monotonic()
    monitor = attach(model, optimizer, run_config={"steps": args.steps})
    print(f"attached in {time.monotonic() - started:.2f} s", flush=True)
    for step in range(args.steps):
        with monitor.step(step) as s:
            x = torch.randn(6, 8)
            losses = model(x).pow(2).mean(dim=1)
            s.loss(losses, torch.ones(6, dtype=torch.bool))
            losses.mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"step {step}", flush=True)
        time.sleep(args.pause_s if step == args.pause_at else args.sleep_s)
    if args.exit_code:
        monitor._emitter.close(10.0)  # the steps leave; no lifecycle event does
        os._exit(args.exit_code)
    started = time.monotonic()
    monitor.close()
    print(f"closed in {time.monotonic() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main()
