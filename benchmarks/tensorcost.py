"""The step tier's rank-side cost against the number of parameter tensors
(``benchmarks/overhead.py --tensors``; issue 35, "rank side, cost flat in tensors").

Models of 10, 100 and 1,000 parameter tensors: ``n / 2`` modules alternating
Linear(32, 32) and LayerNorm(32) (two tensors each), SGD, one intra-op thread, a null
transport. Each size trains two copies on the same input — probes off (the null monitor)
and the step tier every step (``cadence={"step": 1, "scan": 0, "demand": 0}``, clipping
through ``s.clip_grad_norm_``; the off copy clips with torch's own) — in alternating blocks,
``ROUNDS`` rounds, after a warm-up. The figures are thread CPU clocks, not wall time (which
other processes on a shared host move):

  train_cpu_us  the training thread's CPU a step (``time.thread_time``) in the monitor's
                calls (entering and leaving the step, ``loss_totals``, ``clip_grad_norm_``,
                which clips with torch's own), median over rounds of each round's median,
                less the same of the off copy (whose ``clip_grad_norm_`` is torch's): the P0
                tier's work on the training thread (the gradient probe, the seal, the
                hand-off). The whole steps' difference, on stderr, holds the same and the
                optimizer probe's hook, but two 30 ms medians' difference on a loaded host
                moves by milliseconds
  emitter_cpu_us  the emitter thread's CPU a step (``pthread_getcpuclockid`` of
                ``probewire-emitter``), median over rounds of (its CPU over the round's P0
                block) / steps: decoding the step's vectors, reducing the CPU gradient
                blocks, encoding and the (null) send
  p0_ops        the aten:: operations ``torch.profiler`` records on the training thread in
                one P0 step, less those of the same step of the off copy (inner calls
                included): what the step tier runs per step, which must not grow with the
                number of tensors
  p0_launches   the same for the operations no other aten:: operation called: what the
                step tier's Python launches

stdout, one line per size: ``tensors N train_cpu_us X emitter_cpu_us Y p0_ops Z
p0_launches L``; then ``flat train_cpu_us R``, ``flat p0_ops R`` and ``flat p0_launches R``:
the value at 1,000 tensors over the value at 10 (goal <= 1.3). stderr: the off copy's median step CPU per size.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from probewire.instrument import NullTransport, ProbeConfig, RankIdentity, attach

SIZES = (10, 100, 1000)
ROUNDS = 7
BLOCK_STEPS = 10
WARMUP_STEPS = 20
MARK = "probewire.bench.step"
P0 = ProbeConfig(cadence={"step": 1, "scan": 0, "demand": 0}, clip_threshold=1.0)


WIDTHS = {10: 255, 100: 88, 1000: 27}
"""Each size's width: about 200k parameter elements at every size (196,860, 200,200 and
202,500), every tensor small (at most 65,536 elements, ``batchscan.SMALL_ELEMS``)."""


def model_of(tensors: int, width: int) -> torch.nn.Module:
    """``tensors / 2`` modules alternating Linear(width, width) and LayerNorm(width)."""
    layers: list[torch.nn.Module] = [
        torch.nn.Linear(width, width) if i % 2 == 0 else torch.nn.LayerNorm(width)
        for i in range(tensors // 2)
    ]
    return torch.nn.Sequential(*layers)


class Copy:
    """One model copy with its optimizer and monitor (``config`` None: probes off)."""

    def __init__(self, tensors: int, width: int, config: ProbeConfig | None, name: str) -> None:
        torch.manual_seed(0)
        self.model = model_of(tensors, width)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.monitor: Any = attach(
            self.model,
            self.optimizer,
            identity=RankIdentity(run_id=f"tensors-{tensors}-{name}", rank=0, world_size=1),
            config=config or ProbeConfig(enabled=False),
            transport=NullTransport(),
        )
        self.x = torch.randn(8, width)
        self.params = list(self.model.parameters())
        self.step_no = 0

    def step(self) -> float:
        """One training step; returns the training thread's CPU (s) in the monitor's calls
        (entering and leaving the step, ``loss_totals``, ``clip_grad_norm_``)."""
        clock = time.thread_time
        ctx = self.monitor.step(self.step_no)
        t0 = clock()
        s = ctx.__enter__()
        spent = clock() - t0
        loss = self.model(self.x).pow(2).mean()
        t0 = clock()
        s.loss_totals(loss.detach() * self.x.shape[0], self.x.shape[0])
        spent += clock() - t0
        loss.backward()
        t0 = clock()
        s.clip_grad_norm_(self.params, 1.0)  # the off copy's: torch's own
        spent += clock() - t0
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        t0 = clock()
        ctx.__exit__(None, None, None)
        spent += clock() - t0
        self.step_no += 1
        return spent

    def emitter_clock(self) -> Callable[[], float]:
        """The emitter thread's CPU clock (s); a clock that stays 0 without one."""
        thread = getattr(getattr(self.monitor, "_emitter", None), "_thread", None)
        if thread is None or thread.ident is None or not thread.is_alive():
            return lambda: 0.0
        clock = time.pthread_getcpuclockid(thread.ident)
        return lambda: time.clock_gettime(clock)

    def drain(self) -> None:
        """Wait until the emitter has resolved every submitted step (its CPU is counted)."""
        emitter = getattr(self.monitor, "_emitter", None)
        if emitter is not None:
            emitter.flush()


def block_cpu(copy: Copy, steps: int) -> tuple[list[float], list[float], float]:
    """Training-thread CPU (s) of each of ``steps`` steps, whole and in the monitor's calls,
    and the emitter's CPU over them (the emitter drained before and after)."""
    emitter = copy.emitter_clock()
    copy.drain()
    e0 = emitter()
    times, calls = [], []
    for _ in range(steps):
        t0 = time.thread_time()
        calls.append(copy.step())
        times.append(time.thread_time() - t0)
    copy.drain()
    return times, calls, emitter() - e0


def aten_ops(copy: Copy) -> tuple[int, int]:
    """(recorded, launched): the aten:: operations ``torch.profiler`` records on this thread
    during one step of ``copy``, and those among them that no other aten:: operation
    called (an operation's own inner calls, such as a multi-tensor operation's per-tensor
    CPU fallback, are recorded but not launched)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(MARK):
            copy.step()
    events = prof.events()
    me = next(e.thread for e in events if e.name == MARK)  # the profiler's id of this thread
    mine = [e for e in events if e.thread == me and e.name.startswith("aten::")]
    return len(mine), sum(map(_launched, mine))


def _launched(event: Any) -> bool:
    """An aten:: operation with no aten:: operation above it."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def measure(tensors: int, width: int) -> dict[str, float]:
    """One size's figures (see the module docstring)."""
    off, p0 = Copy(tensors, width, None, "off"), Copy(tensors, width, P0, "p0")
    for copy in (off, p0):
        for _ in range(WARMUP_STEPS):
            copy.step()
        copy.drain()
    off_cpu, p0_cpu, off_calls, p0_calls, emitter = [], [], [], [], []
    for _ in range(ROUNDS):
        times, calls, _ = block_cpu(off, BLOCK_STEPS)
        off_cpu.append(statistics.median(times))
        off_calls.append(statistics.median(calls))
        times, calls, spent = block_cpu(p0, BLOCK_STEPS)
        p0_cpu.append(statistics.median(times))
        p0_calls.append(statistics.median(calls))
        emitter.append(spent / BLOCK_STEPS)
    (p0_recorded, p0_launched), (off_recorded, off_launched) = aten_ops(p0), aten_ops(off)
    for copy in (off, p0):
        copy.monitor.close()
    return {
        "train_cpu_us": (statistics.median(p0_calls) - statistics.median(off_calls)) * 1e6,
        "step_cpu_us": (statistics.median(p0_cpu) - statistics.median(off_cpu)) * 1e6,
        "emitter_cpu_us": statistics.median(emitter) * 1e6,
        "p0_ops": float(p0_recorded - off_recorded),
        "p0_launches": float(p0_launched - off_launched),
        "off_cpu_us": statistics.median(off_cpu) * 1e6,
    }


def main(argv: list[str], sizes: tuple[int, ...] = SIZES) -> None:
    """``--width W``: every size at width W (parameter elements grow with the tensors)."""
    logging.getLogger("probewire").setLevel(logging.ERROR)  # the model has no head: said once
    torch.set_num_threads(1)
    fixed = int(argv[argv.index("--width") + 1]) if "--width" in argv else None
    figures = {}
    for n in sizes:
        width = fixed or WIDTHS[n]
        f = figures[n] = measure(n, width)
        print(
            f"# {n} tensors, width {width}: off step {f['off_cpu_us']:.0f} us CPU (median); "
            f"whole steps' difference P0 - off {f['step_cpu_us']:.0f} us",
            file=sys.stderr,
        )
        print(
            f"tensors {n} train_cpu_us {f['train_cpu_us']:.1f} "
            f"emitter_cpu_us {f['emitter_cpu_us']:.1f} p0_ops {f['p0_ops']:.0f} "
            f"p0_launches {f['p0_launches']:.0f}",
            flush=True,
        )
    low, high = figures[sizes[0]], figures[sizes[-1]]
    for key in ("train_cpu_us", "p0_ops", "p0_launches"):
        print(f"flat {key} {high[key] / max(low[key], 1e-9):.2f}")
