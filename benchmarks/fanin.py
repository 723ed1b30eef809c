"""A step's fan-in at cluster scale: P0 latency, P0 after a scan step, worker CPU and RSS.

    python benchmarks/fanin.py [--ranks 64,512,2048,4096] [--steps 8] [--scan-pairs 3]
                               [--workers 1] [--gap-s 1.0] [--budget-s 1500]
    python benchmarks/fanin.py --ranks 16384 --steps 3 --scan-pairs 1 --no-cospike \
                               --step-timeout-s 900                    # few steps, low rate

For each N, a fresh broker (Tansu, in memory), worker and embedded chdb store
(``LocalStack``, all on 127.0.0.1, stopped by PID) and one simulated run of N ranks, each
rank encoded by the ranks' own wire encoder (``load.Ranks`` over ``SimRun``) and produced
with confluent_kafka. Steps are produced one at a time, the next only once the last is
stored and ``--gap-s`` has passed (the worker idle when each starts):

- P0 steps: 49 points a rank (loss sum and tokens, grad norm², step time, 5 tensors' scan
  fields; ``load.py --metrics 49``). The first two steps warm the run up (its pipeline is
  made, its saved state looked up) and are not measured; then ``--steps`` are.
- one co-spike step (``SimRun.cospike_step``: loss x3, gradient x20), after the detectors'
  early history (P0 steps up to step 12, outside the medians): its row's latency and its
  page's, from ``probewire.alerts`` (``--no-cospike``: none, nor the history).
- ``--scan-pairs`` times, four pairs of steps, the second of each a P0 step whose latency
  is measured; the first:
  - ``after_scan_s``: a scan-tier step of 544 points a rank (60 tensors' scan fields); the
    P0 step is sent ``--gap-s`` after the scan step's row is stored, its detail still in
    flight (reduced by the detail worker and written by the owner meanwhile: seconds at
    2,048 ranks). The condition of ``p0_s`` (the step tier idle when the step comes) with
    the detail added: the difference is what the detail costs a page.
  - ``after_p0_s``: a P0 step, the same way (``p0_s`` again, interleaved with the scan
    pairs: the control at the same time and load).
  - ``behind_scan_s``: the scan-tier step; the P0 step sent as soon as the scan step's last
    message is delivered, so it also waits for the scan step's own step tier (49 points a
    rank) to be reduced.
  - ``behind_p0_s``: a P0 step, the same way: a step sent right behind another waits for
    it, detail or not; ``behind_scan_s`` less this is the detail's share.
  The P0 step is encoded before the first step is sent (ranks encode on their own hosts;
  here the encoder would take a core from the workers while they reduce). After each
  scan-tier step, its detail is waited for (the owner's detail writes, from its heartbeat:
  stored_s, within 0.1 s) so that no pair runs beside another pair's detail.

Latency = (the step's row stored) - (the broker's delivery report of the step's last rank
message, timestamped in the producer's delivery callback). "Stored" is the worker's own
heartbeat: it rewrites the file (with ``ts = time.time()``) right after each store write,
``steps_written`` counting the step_metrics rows written; the file is read whenever its
mtime changes (stat every 5 ms) and the ``ts`` of the first version that counts the step
is taken, so no poll interval is added (only when two versions land within 5 ms is one
missed; the later one's ts is at most 5 ms late). The page time is the alert message's
timestamp (the worker's producer sets it when it sends the alert) and, beside it, its
arrival at a consumer here. Medians are printed, with every sample.

CPU: the workers' user+system time (children included; with ``--workers 2`` both
workers) over the measured steps, less their idle rate (timers, heartbeat, broker watch; measured over ``--idle-s`` before them)
times their wall time, per point they carried; the raw figure is printed beside it. RSS:
the store owner's peak (children included), sampled every 50 ms. The 1-minute load average is printed before and
after each N: on a shared 2-core machine every wall time here moves with it.

``--workers 2`` adds a ``--role stage1`` worker (one consumer group): each worker's stage-1
outputs (its heartbeat) are read before every measured step, so each step is attributed
to the worker(s) that reduced it. ``route`` is the one place that decides which topic and
key each rank's points go to.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
from confluent_kafka import Consumer, Producer
from load import Ranks, warm_up

from probewire.deploy.reading import open_client
from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
from probewire.instrument.catalog import Grad, Label
from probewire.instrument.export import split_held
from probewire.instrument.plumbing import TopicConfig, read_heartbeat
from probewire.instrument.wire import Point, WireEncoder, message_key
from probewire.stream.testing import SimRun

say = functools.partial(print, flush=True)

GROUPS = 9  # step tier: 4 + 9 gradient groups x 5 fields = 49 points a rank
SCAN_TENSORS = 60  # a scan step adds 60 tensors x 9 = 540 scan-tier points a rank
GROUP_FIELDS = (Grad.ABS_SUM, Grad.ABS_MAX, Grad.ZEROS, Grad.ELEMENTS, Grad.NONFINITE)
WARM_STEPS = 2
EARLY_HISTORY = 12  # steps before the co-spike (DetectorConfig.early_history is 10)
METRICS_TOPIC, DETAIL_TOPIC = TopicConfig().metrics, TopicConfig().detail

PROCESSES = ("owner", "broker", "other workers")  # Bench.cpu_by_process
RankPoints = tuple[int, WireEncoder, list[Point]]  # (rank, its encoder, its points)
Routed = list[tuple[str, bytes, bytes]]  # (topic, key, value)


def route(run_id: str, step: int, ranks: list[RankPoints], block_ranks: int) -> Routed:
    """Which topic and key each rank's points of one step go to, as ``StepEmitter`` sends
    them: the step tier on ``otlp_metrics``, keyed ``run:step:rank//B`` when the job has
    more ranks than B (``run:step`` otherwise), the scan tier (if any) on ``otlp_detail``,
    keyed ``run:step``."""
    routed = []
    for rank, enc, points in ranks:
        step_tier, scan = split_held(points)
        block = rank // block_ranks if len(ranks) > block_ranks else None
        routed.append(
            (METRICS_TOPIC, message_key(run_id, step, block), enc.encode(step, step_tier))
        )
        if scan:
            routed.append((DETAIL_TOPIC, message_key(run_id, step), enc.encode(step, scan)))
    return routed


def grad_groups(rng: np.random.Generator) -> list[Point]:
    """Step-tier points: 9 gradient groups' abs sum, abs max, zeros, elements, non-finite."""
    x = np.abs(rng.normal(0.0, 0.02, (GROUPS, 2)))
    return [
        Point(name, float(v), ((Label.GROUP, f"g{g}"),))
        for g in range(GROUPS)
        for name, v in zip(GROUP_FIELDS, (x[g, 0] * 4096, x[g, 1], 3.0, 4096.0, 0.0))
    ]


def rank_points(ranks: Ranks, step: int) -> list[RankPoints]:
    """Every rank's points of one step, as ``Ranks.messages`` builds them, unencoded."""
    rng = np.random.default_rng(step)
    return [
        (
            r,
            enc,
            [Point(n, v) for n, v in ranks.run.components(step, r).items()]
            + grad_groups(rng)
            + ranks.scan(rng),
        )
        for r, enc in enumerate(ranks.encoders)
    ]


@dataclass
class Watch:
    """A thread that follows the worker: stored steps (heartbeat), pages (alerts topic),
    peak RSS; the producer's delivery reports land here too."""

    stack: LocalStack
    run_id: str
    stored: list[tuple[int, float]] = field(default_factory=list)  # (steps_written, ts)
    pages: dict[int, tuple[float, float]] = field(default_factory=dict)  # step: (sent, got)
    delivered: dict[int, float] = field(default_factory=dict)  # step: last delivery
    details: list[tuple[int, float]] = field(default_factory=list)  # (detail parts stored, ts)
    seen: list[tuple[int, float, float]] = field(default_factory=list)  # ``read_loop``
    failed: int = 0
    rss_peak: int = 0
    stop: threading.Event = field(default_factory=threading.Event)
    ready: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_delivery(self, step: int, err: object, _msg: object) -> None:
        now = time.time()
        if err is not None:
            self.failed += 1
        elif now > self.delivered.get(step, 0.0):
            self.delivered[step] = now

    def run(self) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": self.stack.bootstrap,
                "group.id": uuid.uuid4().hex,
                "auto.offset.reset": "latest",
                "fetch.wait.max.ms": 5,
            }
        )
        consumer.subscribe([self.stack.settings.topics.alerts])
        while not consumer.assignment() and not self.stop.is_set():
            consumer.poll(0.1)
        self.ready.set()
        worker = psutil.Process(self.stack.worker.pid)  # type: ignore[union-attr]
        mtime, polls = 0, 0
        while not self.stop.is_set():
            msg = consumer.poll(0.005)
            if msg is not None and not msg.error():
                self._page(json.loads(msg.value()), msg.timestamp()[1] / 1000)
            try:
                now_mtime = os.stat(self.stack.heartbeat_path).st_mtime_ns
            except FileNotFoundError:
                now_mtime = mtime
            if now_mtime != mtime:
                mtime = now_mtime
                self._beat(read_heartbeat(self.stack.heartbeat_path) or {})
            polls += 1
            if polls % 10 == 0:
                self.rss_peak = max(self.rss_peak, rss(worker))
        consumer.close()

    def _page(self, alert: dict, sent: float) -> None:
        if alert.get("run_id") == self.run_id and alert.get("signal") == "cospike":
            self.pages.setdefault(int(alert["step"]), (sent, time.time()))

    def _beat(self, beat: dict) -> None:
        written = int(beat.get("runs", {}).get(self.run_id, {}).get("steps_written", 0))
        detail = beat.get("stages", {}).get("detail", {})
        with self.lock:
            if not self.stored or written > self.stored[-1][0]:
                self.stored.append((written, float(beat["ts"])))
            if detail.get("output_age_s") is not None and int(detail["outputs"]) > (
                self.details[-1][0] if self.details else 0
            ):  # the owner's last detail write: the beat's time less its age (0.1 s)
                self.details.append(
                    (int(detail["outputs"]), float(beat["ts"]) - float(detail["output_age_s"]))
                )

    def detail_outputs(self) -> int:
        """Detail parts the owner has stored so far (``Worker.on_detail_step``)."""
        with self.lock:
            return self.details[-1][0] if self.details else 0

    def detail_settled(self, before: int, timeout_s: float, quiet_s: float = 2.5) -> float | None:
        """When the owner stored its last detail part, once more than ``before`` are stored
        and no other came for ``quiet_s`` (heartbeats come at least once a second); None
        after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                last = self.details[-1] if self.details else (0, 0.0)
            if last[0] > before and time.time() - last[1] >= quiet_s:
                return last[1]
            time.sleep(0.05)
        return None

    def read_loop(self, interval_s: float = 0.05) -> None:
        """``--verify-read``: the run's step_metrics rows counted through the worker's live
        reader every ``interval_s``; ``seen`` gets (count, query start, query end) each time
        the count grows (the row became visible between the previous query's start and
        this one's end)."""
        client = open_client(self.stack.settings.clickhouse.url)
        sql = (
            f"SELECT count() FROM {self.stack.settings.clickhouse.database}.step_metrics "
            "WHERE run_id = {run:String}"
        )
        last, before = 0, time.time()
        while not self.stop.is_set():
            start = time.time()
            count = int(client.query(sql, parameters={"run": self.run_id}).result_rows[0][0])
            if count > last:
                self.seen.append((count, before, time.time()))
                last = count
            before = start
            self.stop.wait(interval_s)

    def visible(self, count: int) -> tuple[float, float] | None:
        """``--verify-read``: bounds on when the run's ``count``-th row became visible to
        the reader: after the previous query began, before the first one that saw it ended."""
        return next(((lo, hi) for n, lo, hi in self.seen if n >= count), None)

    def stored_at(self, count: int, timeout_s: float, lost: Callable[[], bool]) -> float | None:
        """The heartbeat ts of the first store write that made ``count`` steps stored; None
        after ``timeout_s`` or once ``lost()`` (asked once a second)."""
        deadline = time.monotonic() + timeout_s
        polls = 0
        while time.monotonic() < deadline and (polls % 100 or not lost()):
            with self.lock:
                hit = next((ts for n, ts in self.stored if n >= count), None)
            if hit is not None:
                return hit
            time.sleep(0.01)
            polls += 1
        return None


def worker_log(stack: LocalStack) -> str:
    try:
        return (stack.work_dir / "worker.log").read_text(errors="replace")
    except OSError:
        return ""


def last_error(stack: LocalStack) -> str:
    """The last ERROR line of the worker's log (what a step that is not stored met)."""
    lines = worker_log(stack).splitlines()
    return next(
        (ln.split("ERROR", 1)[1].strip() for ln in reversed(lines) if "ERROR" in ln), "none"
    )


def rss(proc: psutil.Process) -> int:
    try:
        return proc.memory_info().rss + sum(c.memory_info().rss for c in proc.children(True))
    except psutil.Error:
        return 0


def cpu_s(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` (every worker) and their children."""
    return sum(sum(p.cpu_times()[:4]) for p in procs)


def stage1_outputs(stack: LocalStack) -> dict[str, int]:
    """Steps (or parts) each worker's stage 1 has reduced, from their heartbeats."""
    paths = {"owner": stack.heartbeat_path} | {
        f"stage1-{i}": stack.work_dir / f"worker-stage1-{i}.heartbeat"
        for i in range(len(stack.stage1_workers))
    }
    return {
        name: int(
            (read_heartbeat(path) or {}).get("stages", {}).get("stage1", {}).get("outputs", 0)
        )
        for name, path in paths.items()
    }


@dataclass
class Bench:
    """One N: the stack, the run, the producer, and what was measured."""

    stack: LocalStack
    watch: Watch
    p0: Ranks
    scan: Ranks
    args: argparse.Namespace
    producer: Producer = field(init=False)
    produced: int = 0  # steps produced so far (== the count stored once each is)
    points: int = 0  # points of the measured steps
    reducers: list[dict[str, int]] = field(default_factory=list)  # per measured step
    counts: dict[int, int] = field(default_factory=dict)  # step: rows stored with it
    sampled: dict[str, list[int]] = field(default_factory=dict)  # kind: steps measured
    step_cpu: dict[str, list[list[float]]] = field(default_factory=dict)  # kind: [PROCESSES]

    def cpu_by_process(self) -> list[float]:
        """CPU seconds so far of the owner, the broker, the other workers (``PROCESSES``)."""
        others = [psutil.Process(p.pid) for p in self.stack.stage1_workers]
        return [
            cpu_s([psutil.Process(p.pid)]) if p else 0.0
            for p in (self.stack.worker, self.stack.broker)
        ] + [cpu_s(others)]

    def __post_init__(self) -> None:
        self.producer = Producer(
            {
                "bootstrap.servers": self.stack.bootstrap,
                "partitioner": "murmur2_random",  # as the ranks' KafkaTransport
                "linger.ms": 5,
                "queue.buffering.max.kbytes": 2_097_151,
                "queue.buffering.max.messages": 1_000_000,
            }
        )

    def encode(self, ranks: Ranks, step: int) -> tuple[Routed, int]:
        """One step's messages (every rank), and its points."""
        points = rank_points(ranks, step)
        routed = route(ranks.run.run_id, step, points, self.args.block_ranks)
        return routed, sum(len(p) for _, _, p in points)

    def send(
        self,
        ranks: Ranks,
        step: int,
        measured: bool = True,
        encoded: tuple[Routed, int] | None = None,
    ) -> None:
        """Produce one step (``encoded``, or encoded now) and wait for its delivery reports."""
        routed, points = encoded or self.encode(ranks, step)
        callback = functools.partial(self.watch.on_delivery, step)
        for topic, key, value in routed:
            while True:
                try:
                    self.producer.produce(topic, key=key, value=value, on_delivery=callback)
                    break
                except BufferError:
                    self.producer.poll(0.05)
        self.producer.flush(120)
        self.produced += 1
        if measured:
            self.points += points

    def latency(self, step: int) -> float | None:
        """Seconds from the step's last delivery to the store write that counted it."""
        lost = f"step {step} of run {self.p0.run.run_id} not published"
        stored = self.watch.stored_at(
            self.produced, self.args.step_timeout_s, lambda: lost in worker_log(self.stack)
        )
        if stored is None:
            say(
                f"  step {step}: not stored within {self.args.step_timeout_s}s or lost; the "
                f"worker's last error: {last_error(self.stack)}"
            )
            return None
        self.counts[step] = self.produced
        return stored - self.watch.delivered[step]

    def read_latency(self, steps: list[int]) -> str:
        """``--verify-read``: the same steps' latency to the reader's first sight of their
        row (the bounds [previous query's start, first sight] on it, in s)."""
        spans = []
        for step in steps:
            seen = self.watch.visible(self.counts[step])
            if seen is not None:
                lo, hi = (t - self.watch.delivered[step] for t in seen)
                spans.append(f"[{lo:.3f},{hi:.3f}]")
        return " ".join(spans)

    def settle(self, measured: bool = True) -> None:
        """The gap before the next step (the worker idle); with stage-1 workers, each
        worker's stage-1 outputs since the last step (their heartbeats come once a second)."""
        time.sleep(self.args.gap_s if len(self.stack.stage1_workers) == 0 else 1.2)
        if measured:
            self.reducers.append(stage1_outputs(self.stack) | {"steps": self.produced})


def measure(bench: Bench, began: float, step: int) -> dict[str, list[float]]:
    """The sequence of the module docstring from ``step`` on; every latency sample by kind.
    Every step sent here counts in the CPU per point (the early-history ones too)."""
    args = bench.args
    kinds = ("p0", "after_scan", "after_p0", "behind_scan", "behind_p0", "cospike_row", "detail")
    out: dict[str, list[float]] = {k: [] for k in kinds}
    out["page"], out["page_seen"] = [], []

    def one(kind: str | None, encoded: tuple[Routed, int] | None = None) -> None:
        nonlocal step
        before = bench.cpu_by_process()
        bench.send(bench.p0, step, encoded=encoded)
        if (lat := bench.latency(step)) is not None and kind is not None:
            out[kind].append(lat)
            bench.sampled.setdefault(kind, []).append(step)
            after = bench.cpu_by_process()
            bench.step_cpu.setdefault(kind, []).append([a - b for a, b in zip(after, before)])
        bench.settle()
        step += 1

    for _ in range(args.steps):
        if time.monotonic() - began > args.budget_s:
            say("  (budget spent: fewer P0 steps)")
            break
        one("p0")
    if not args.no_cospike:
        while step < EARLY_HISTORY:  # the detectors' early history, not in the medians
            one(None)
        bench.p0.run.cospike_step = step
        one("cospike_row")
        page(bench, bench.p0.run.cospike_step, out)
    for _ in range(args.scan_pairs):
        if time.monotonic() - began > args.budget_s:
            say("  (budget spent: fewer scan pairs)")
            break
        for first, kind, stored in (
            (bench.scan, "after_scan", True),
            (bench.p0, "after_p0", True),
            (bench.scan, "behind_scan", False),
            (bench.p0, "behind_p0", False),
        ):
            after = bench.encode(bench.p0, step + 1)  # first: ranks encode on their hosts
            detail = bench.watch.detail_outputs()
            bench.send(first, step)
            if stored:  # its row stored and the gap: the step tier idle, its detail not
                bench.latency(step)
                bench.settle(measured=False)
            step += 1
            one(kind, after)
            if first is bench.scan:  # its detail stored before the next pair begins
                if (done := bench.watch.detail_settled(detail, args.step_timeout_s)) is None:
                    say(f"  the detail of step {step - 2} not stored in {args.step_timeout_s}s")
                else:
                    out["detail"].append(done - bench.watch.delivered[step - 2])
    return out


def page(bench: Bench, step: int, out: dict[str, list[float]]) -> None:
    """The co-spike step's page: its alert's timestamp and its arrival here, less the
    step's last delivery (waited for up to 10 s)."""
    deadline = time.monotonic() + 10
    while step not in bench.watch.pages and time.monotonic() < deadline:
        time.sleep(0.05)
    if (got := bench.watch.pages.get(step)) is not None:
        out["page"].append(got[0] - bench.watch.delivered[step])
        out["page_seen"].append(got[1] - bench.watch.delivered[step])
    else:
        say(f"  no cospike page for step {step} within 10 s")


def check_rows(settings: Settings, run: SimRun, steps: int) -> str:
    """Every produced step stored once, with every rank, and L against the float64
    reference (``SimRun.expected``), read through the worker's live reader."""
    client = open_client(settings.clickhouse.url)
    db = settings.clickhouse.database
    rows = client.query(
        f"SELECT step, ranks_reporting, loss FROM {db}.step_metrics FINAL "
        "WHERE run_id = {run:String} ORDER BY step",
        parameters={"run": run.run_id},
    ).result_rows
    full = sum(1 for _, n, _ in rows if n == run.world_size)
    errors = [abs(loss / run.expected(s)[0] - 1) for s, _, loss in rows]
    return (
        f"{len(rows)}/{steps} steps stored, {full} with all {run.world_size} ranks, "
        f"L max relative error {max(errors, default=float('nan')):.1e} vs float64"
    )


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fmt(xs: list[float]) -> str:
    return "[" + " ".join(f"{x:.3f}" for x in xs) + "]"


def report(n: int, bench: Bench, lat: dict[str, list[float]], cpu: tuple[float, float]) -> None:
    worker_cpu, idle = cpu
    net = worker_cpu - idle
    say(
        f"fanin ranks {n} p0_s {median(lat['p0']):.3f} after_scan_s "
        f"{median(lat['after_scan']):.3f} cpu_us_per_point {net / bench.points * 1e6:.2f} "
        f"rss_mb {bench.watch.rss_peak / 2**20:.0f} after_p0_s {median(lat['after_p0']):.3f} "
        f"behind_scan_s {median(lat['behind_scan']):.3f} behind_p0_s "
        f"{median(lat['behind_p0']):.3f}"
    )
    say(
        f"  samples p0_s {fmt(lat['p0'])} after_scan_s {fmt(lat['after_scan'])} after_p0_s "
        f"{fmt(lat['after_p0'])} behind_scan_s {fmt(lat['behind_scan'])} behind_p0_s "
        f"{fmt(lat['behind_p0'])} scan detail stored_s {fmt(lat['detail'])} cospike row_s "
        f"{fmt(lat['cospike_row'])} page_s {fmt(lat['page'])} (seen here "
        f"{fmt(lat['page_seen'])})"
    )
    say(
        f"  cpu: worker(s) {worker_cpu:.2f}s over the measured steps, idle share {idle:.2f}s, "
        f"{bench.points:,} points; raw {worker_cpu / bench.points * 1e6:.2f} us/point; "
        f"delivery errors {bench.watch.failed}"
    )
    say(
        "  cpu s from a measured step's send to its row (median; "
        + "/".join(PROCESSES)
        + "): "
        + " ".join(
            f"{kind} " + "/".join(f"{median(list(col)):.2f}" for col in zip(*rows))
            for kind, rows in bench.step_cpu.items()
        )
    )
    if bench.stack.stage1_workers:
        marks = bench.reducers
        spans = [
            (
                {
                    w: marks[i][w] - marks[i - 1][w]
                    for w in marks[i]
                    if w != "steps" and marks[i][w] > marks[i - 1][w]
                },
                marks[i]["steps"] - marks[i - 1]["steps"],
            )
            for i in range(1, len(marks))
        ]
        single = [by for by, steps in spans if steps == 1]
        say(
            "  reduced by (stage-1 outputs between steps; a scan pair is 2 steps): "
            + " ".join(
                ("+".join(f"{w}:{c}" for w, c in by.items()) or "-")
                + (f"({steps} steps)" if steps > 1 else "")
                for by, steps in spans
            )
            + "; single steps reduced on more than one worker: "
            f"{sum(1 for by in single if len(by) > 1)}/{len(single)}"
        )


def idle_rate(proc: list[psutil.Process], seconds: float) -> float:
    """The worker's CPU seconds per second while nothing is produced."""
    c0, t0 = cpu_s(proc), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(proc) - c0) / (time.monotonic() - t0)


def one_n(n: int, args: argparse.Namespace, tmp: Path, began: float) -> None:
    say(f"ranks {n}: load average {os.getloadavg()[0]:.2f} before")
    settings = Settings(
        clickhouse=ClickHouseSettings(url="chdb:///" + str(Path(tmp, f"store{n}")).lstrip("/")),
        stream=StreamSettings(
            app_id=f"fanin-{uuid.uuid4().hex[:6]}",
            block_ranks=args.block_ranks,
            max_message_bytes=args.max_message_bytes,
            detail_inline=not args.detail_worker,
        ),
    )
    run = SimRun(run_id=f"fanin-{n}-{uuid.uuid4().hex[:4]}", world_size=n)
    with LocalStack(settings, Path(tmp, f"run{n}")) as stack:
        stack.start_broker()
        stack.start_worker()
        stack.start_stage1_workers(args.workers - 1)
        if args.detail_worker:
            stack.start_stage1_workers(1, role="detail")
        warm_up(stack, 0)
        watch = Watch(stack, run.run_id)
        thread = threading.Thread(target=watch.run, daemon=True)
        thread.start()
        reader = threading.Thread(target=watch.read_loop, daemon=True)
        if args.verify_read:
            reader.start()
        watch.ready.wait(60)
        bench = Bench(stack, watch, Ranks(run, 0), Ranks(run, SCAN_TENSORS), args)
        for step in range(WARM_STEPS):  # the run's pipeline is made, its state looked up
            bench.send(bench.p0, step, measured=False)
            bench.latency(step)
            bench.settle(measured=False)
        worker = [psutil.Process(p.pid) for p in (stack.worker, *stack.stage1_workers) if p]
        rate = idle_rate(worker, args.idle_s)
        bench.reducers.append(stage1_outputs(stack) | {"steps": bench.produced})
        c0, t0 = cpu_s(worker), time.monotonic()
        lat = measure(bench, began, WARM_STEPS)
        cpu = (cpu_s(worker) - c0, rate * (time.monotonic() - t0))
        watch.stop.set()
        thread.join(10)
        if args.verify_read:
            reader.join(10)
        report(n, bench, lat, cpu)
        if args.verify_read:
            say(
                "  reader (50 ms polls): row visible within [lo, hi] s of the last delivery: "
                + "; ".join(f"{k} {bench.read_latency(v)}" for k, v in bench.sampled.items())
            )
        say(f"  store: {check_rows(settings, run, bench.produced)}")
        del bench  # its producer goes before the broker it talks to
    say(f"ranks {n}: load average {os.getloadavg()[0]:.2f} after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="64,512,2048,4096", help="comma-separated Ns")
    parser.add_argument("--steps", type=int, default=8, help="measured P0 steps per N")
    parser.add_argument("--scan-pairs", type=int, default=3, help="scan step + P0 step pairs")
    parser.add_argument("--workers", type=int, default=1, help="the owner + N-1 stage1")
    parser.add_argument("--gap-s", type=float, default=1.0, help="idle time between steps")
    parser.add_argument("--idle-s", type=float, default=4.0, help="idle CPU rate window")
    parser.add_argument(
        "--no-cospike",
        action="store_true",
        help="no co-spike step (and none of the 12 steps of history it needs): large N",
    )
    parser.add_argument(
        "--verify-read",
        action="store_true",
        help="also poll the worker's reader every 50 ms and compare (costs worker CPU)",
    )
    parser.add_argument("--step-timeout-s", type=float, default=300.0)
    parser.add_argument("--block-ranks", type=int, default=256, help="stream.block_ranks")
    parser.add_argument(
        "--detail-worker",
        action="store_true",
        help="a --role detail worker reduces otlp_detail (the owner: detail_inline false)",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=1_000_000,
        help="stream.max_message_bytes: a step's main part holds 7 values a rank",
    )
    parser.add_argument("--budget-s", type=float, default=1500.0, help="no new step after")
    args = parser.parse_args()
    ns = [int(x) for x in args.ranks.split(",") if x.strip()]
    if args.workers < 1 or args.steps < 1 or args.scan_pairs < 0 or not ns:
        parser.error("--workers and --steps must be >= 1, --scan-pairs >= 0, --ranks not empty")
    say(
        f"config: ranks={ns} points/rank p0={4 + 5 * GROUPS} scan=+{9 * SCAN_TENSORS} "
        f"block_ranks={args.block_ranks} detail_worker={args.detail_worker} "
        f"steps={args.steps} scan_pairs={args.scan_pairs} workers={args.workers} "
        f"gap={args.gap_s}s partitions={Settings().topics.partitions} broker=tansu(memory) "
        f"store=chdb cores={os.cpu_count()} budget={args.budget_s}s "
        f"load={' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pw-fanin-") as tmp:
        for n in ns:
            if time.monotonic() - began > args.budget_s:
                say(f"ranks {n}: skipped, budget spent")
                continue
            one_n(n, args, Path(tmp), began)
    say(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
