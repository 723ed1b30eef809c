"""Sustained load through the real broker, worker and store: where does lag start to grow?

    python benchmarks/load.py --ranks 256 --metrics 100 [--rate 1] [--growth 1.5]
                              [--seconds 40] [--budget-s 420]

N simulated ranks each send one OTLP message per step with M metrics (the loss
components, the gradient norm², the step time and whole tensors' one-pass scan fields:
``4 + 9k`` points, k chosen so the count is nearest M), encoded by the ranks' own wire
encoder, produced at a set step rate into the local Tansu broker; one worker process
(stage 1, stage 2, chdb store) consumes them. Each offered rate runs ``--seconds``; the
next rate is ``--growth`` times higher, until the lag grows or ``--budget-s`` is spent.

Lag is counted in steps, end to end: steps produced minus steps the worker has stored
(its heartbeat), sampled every second. Broker offsets are not used: Tansu's end offsets
are wrong for batched writes. Printed per rate: the lag over time, the offered and
sustained (stored) steps/s and points/s, the worker's RSS, and the lag's slope over the
window after its first third; lag "grows" when that slope exceeds 5 % of the offered
rate and the window ends more than two seconds' worth of steps behind. The last line
names the rate where lag starts to grow. The producer, broker and worker share this
machine's cores: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
from confluent_kafka import Producer

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
from probewire.instrument.catalog import Group, Label, Tensor
from probewire.instrument.wire import Point, RankIdentity, WireEncoder, message_key
from probewire.stream.testing import SimRun

say = functools.partial(print, flush=True)  # progress shows while the benchmark runs

BASE_POINTS = 4  # SimRun.components: loss sum, loss tokens, grad norm², step time


def tensors_for(metrics: int) -> int:
    """Whole tensors (9 scan fields each) so that 4 + 9k is nearest ``metrics``."""
    return max(0, round((metrics - BASE_POINTS) / len(Tensor.ALL)))


class Ranks:
    """Every rank's encoder, and one step's messages from all of them."""

    def __init__(self, run: SimRun, tensors: int) -> None:
        self.run = run
        self.encoders = [
            WireEncoder(
                RankIdentity(
                    run_id=run.run_id,
                    rank=r,
                    world_size=run.world_size,
                    host=f"node{r // 8}",
                    coords={Group.DATA.value: r},
                ).resource_attributes()
            )
            for r in range(run.world_size)
        ]
        self.labels = [((Label.KIND, "fwd"), (Label.TENSOR, f"block{t}")) for t in range(tensors)]
        self.points_per_message = BASE_POINTS + tensors * len(Tensor.ALL)

    def scan(self, rng: np.random.Generator) -> list[Point]:
        n = 4096.0
        x = rng.normal(0.0, 0.02, 5)
        values = (
            n,
            x[0] * n,
            abs(x[1]) * n,
            abs(x[2]) * n,
            abs(x[3]) * 4,
            0.0,
            0.0,
            x[4] * n * 1e-4,
            abs(x[4]) * n * 1e-5,
        )
        return [
            Point(name, float(v), labels)
            for labels in self.labels
            for name, v in zip(Tensor.ALL, values)
        ]

    def messages(self, step: int) -> list[tuple[bytes, bytes]]:
        rng = np.random.default_rng(step)
        key = message_key(self.run.run_id, step)
        return [
            (
                key,
                enc.encode(
                    step,
                    [Point(n, v) for n, v in self.run.components(step, r).items()] + self.scan(rng),
                ),
            )
            for r, enc in enumerate(self.encoders)
        ]


@dataclass
class Window:
    """One offered rate: samples of (seconds, produced, stored, rss bytes)."""

    rate: float
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)
    produced: int = 0
    produce_s: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds in the window

    def slope(self) -> float:
        """Lag growth in steps/s over the samples after the window's first third."""
        t = np.array([s[0] for s in self.samples], dtype=np.float64)
        lag = np.array([s[1] - s[2] for s in self.samples], dtype=np.float64)
        keep = t >= t[-1] / 3
        return float(np.polyfit(t[keep], lag[keep], 1)[0]) if keep.sum() >= 3 else 0.0

    def grows(self) -> bool:
        """The lag climbs (> 5 % of the offered rate) and ends over 2 s of steps behind."""
        produced, stored = self.samples[-1][1:3]
        return self.slope() > 0.05 * self.rate and produced - stored > 2 * self.rate


def stored(stack: LocalStack, run_id: str) -> int:
    return stack.progress(run_id)


def warm_up(stack: LocalStack, tensors: int) -> None:
    """Store a 5-step run first: a ready worker's consumer group may still be forming, and
    the first offered rate would count that wait as lag."""
    warm = Ranks(SimRun(run_id=f"warm-{uuid.uuid4().hex[:6]}", world_size=8), tensors)
    producer = Producer({"bootstrap.servers": stack.bootstrap})
    for step in range(5):
        for key, value in warm.messages(step):
            producer.produce("otlp_metrics", key=key, value=value)
    producer.flush(30)
    deadline = time.monotonic() + 120
    while stored(stack, warm.run.run_id) < 5 and time.monotonic() < deadline:
        time.sleep(0.1)


def offer(stack: LocalStack, ranks: Ranks, rate: float, seconds: float) -> Window:
    """Produce ``rate`` steps/s for ``seconds`` while sampling lag and RSS once a second."""
    window = Window(rate)
    producer = Producer(
        {
            "bootstrap.servers": stack.bootstrap,
            "linger.ms": 5,
            "queue.buffering.max.kbytes": 1_048_576,
        }
    )
    stop = threading.Event()

    def produce() -> None:
        started = time.perf_counter()
        step = 0
        while not stop.is_set():
            due = started + step / rate
            wait = due - time.perf_counter()
            if wait > 0:
                stop.wait(wait)
                continue
            for key, value in ranks.messages(step):
                while True:
                    try:
                        producer.produce("otlp_metrics", key=key, value=value)
                        break
                    except BufferError:
                        producer.poll(0.05)
            producer.poll(0)
            step += 1
            window.produced = step
        window.produce_s = time.perf_counter() - started
        producer.flush(30)

    thread = threading.Thread(target=produce, daemon=True)
    worker = psutil.Process(stack.worker.pid)
    procs = {
        "worker": worker,
        "broker": psutil.Process(stack.broker.pid),
        "ranks (this process)": psutil.Process(),
    }
    cpu0 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    started = time.perf_counter()
    thread.start()
    say(f"  rate {rate:.2f} steps/s offered: t(s) produced stored lag(steps) worker_rss(MB)")
    while (now := time.perf_counter() - started) < seconds:
        time.sleep(1.0)
        sample = (now, window.produced, stored(stack, ranks.run.run_id), worker.memory_info().rss)
        window.samples.append(sample)
        if len(window.samples) % 5 == 0:
            say(
                f"    {sample[0]:5.1f} {sample[1]:6d} {sample[2]:6d} {sample[1] - sample[2]:5d} "
                f"{sample[3] / 2**20:8.0f}"
            )
    window.cpu_s = {name: sum(p.cpu_times()[:2]) - cpu0[name] for name, p in procs.items()}
    stop.set()
    thread.join(60)
    return window


def report(window: Window, ranks: Ranks) -> None:
    t0, _, stored0, _ = window.samples[0]
    t1, produced1, stored1, _ = window.samples[-1]
    offered = window.produced / window.produce_s if window.produce_s else 0.0
    sustained = (stored1 - stored0) / (t1 - t0)
    points = ranks.run.world_size * ranks.points_per_message
    rss = max(s[3] for s in window.samples) / 2**20
    lag0 = window.samples[0][1] - window.samples[0][2]
    say(
        f"  offered {offered:.2f} steps/s ({offered * points:,.0f} points/s); sustained "
        f"{sustained:.2f} steps/s ({sustained * points:,.0f} points/s) stored; lag "
        f"{lag0} -> {produced1 - stored1} steps (slope {window.slope():+.2f} steps/s); "
        f"worker RSS max {rss:.0f} MB; lag {'GROWS' if window.grows() else 'steady'}"
    )
    span = window.samples[-1][0]
    busy = ", ".join(f"{name} {cpu / span:.0%}" for name, cpu in window.cpu_s.items())
    per_step = window.cpu_s["worker"] / max(stored1, 1)
    say(
        f"  CPU of one core: {busy}; the worker spent {per_step * 1e3:.0f} ms CPU per stored "
        f"step (at most {1 / per_step:.2f} steps/s on a core of its own)"
    )


def drain(stack: LocalStack, run_id: str, produced: int, timeout_s: float) -> float | None:
    """Seconds until every produced step of the window is stored (None: not within timeout)."""
    started = time.perf_counter()
    while stored(stack, run_id) < produced:
        if time.perf_counter() - started > timeout_s:
            return None
        time.sleep(0.5)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--metrics", type=int, default=100)
    parser.add_argument("--rate", type=float, default=1.0, help="first offered steps/s")
    parser.add_argument("--growth", type=float, default=1.5, help="next rate = rate x growth")
    parser.add_argument("--seconds", type=float, default=40.0, help="per offered rate")
    parser.add_argument("--budget-s", type=float, default=420.0, help="whole sweep, bounded")
    args = parser.parse_args()
    tensors = tensors_for(args.metrics)
    per_message = BASE_POINTS + tensors * len(Tensor.ALL)
    say(
        f"config: ranks={args.ranks} metrics/message={per_message} (asked {args.metrics}) "
        f"first rate={args.rate} growth={args.growth} seconds/rate={args.seconds} "
        f"budget={args.budget_s}s broker=tansu(memory) store=chdb worker=1 process "
        f"cores={os.cpu_count()} load={os.getloadavg()[0]:.2f}"
    )
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pw-load-") as tmp:
        settings = Settings(
            clickhouse=ClickHouseSettings(url="chdb:///" + str(Path(tmp, "store")).lstrip("/")),
            stream=StreamSettings(app_id=f"load-{uuid.uuid4().hex[:6]}"),
        )
        with LocalStack(settings, Path(tmp, "run")) as stack:
            stack.start_broker()
            stack.start_worker()
            warm_up(stack, tensors)
            rate, kept_up = args.rate, None
            while time.monotonic() - began + args.seconds <= args.budget_s:
                run = SimRun(
                    run_id=f"load-{args.ranks}x{per_message}-{rate:.2f}", world_size=args.ranks
                )
                ranks = Ranks(run, tensors)
                window = offer(stack, ranks, rate, args.seconds)
                report(window, ranks)
                if window.grows():
                    say(
                        f"lag starts to grow at {rate:.2f} steps/s "
                        f"({rate * args.ranks * per_message:,.0f} points/s offered); "
                        f"kept up at {kept_up:.2f} steps/s"
                        if kept_up
                        else f"lag grows already at the first rate {rate:.2f} steps/s"
                    )
                    break
                kept_up = rate
                left = args.budget_s - (time.monotonic() - began)
                took = drain(stack, run.run_id, window.produced, max(left, 1.0))
                if took is None:
                    say("  (budget spent draining)")
                    break
                rate *= args.growth
            else:
                say(
                    f"budget spent: lag steady up to {kept_up} steps/s"
                    if kept_up
                    else "budget spent before a whole window ran"
                )
    say(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
