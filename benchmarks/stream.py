"""Stream worker throughput and alert latency, on the local broker and embedded store.

    python benchmarks/stream.py [--ranks 8] [--steps 600] [--alerts 20] [--stages]
    python benchmarks/stream.py --workers 2 --runs 4 [--steps 600]

1. Throughput: 8 simulated ranks x N steps, ~50 points per message (loss, gradient and
   per-tensor statistics), pre-published to ``otlp_metrics``; one worker process starts,
   and the time runs from the moment 10 % of the steps are stored to the moment 90 % are
   (sustained: the worker's start, its group join and its first and last store batches
   fall outside). Prints ``N points/s`` and the worker's CPU time over that window (all
   its threads): points per CPU-second varies less than points/s on a machine busy with
   other work; and the 1-minute load average at its start (other work on a 2-core machine
   moved both rates by 2x and more: compare builds only in interleaved runs at a similar
   load).
2. Alert latency: a live run paced at ~40 steps/s with a co-spike every 25 steps; the
   latency is from the flush of a co-spike step's last rank message to the alert's
   arrival on ``probewire.alerts``. Prints ``latency p50 X ms p99 Y ms``.
3. ``--stages`` (instead of 1 and 2): the worker's stages in this process, without Kafka,
   on the same messages, each as CPU µs a point (process CPU time, all threads: the store
   engine's too; on a shared 2-core host CPU time varies far less than wall time): stage 1
   (decode, reduce, to_bytes), the decode alone through the layouts stage 1 learned and
   field by field (µs a message, side by side), then from_bytes, stage 2 (``accept``) and
   the store write (rows, promotion, saved state) with the stage-2 batch at 40 and at 200
   steps, side by side, so the cost of small store batches shows as a ratio.
4. ``--workers N --runs R`` (instead of 1 and 2): scale-out. R runs of ``--steps`` steps,
   first on 1 worker, then on N workers (the store owner plus N-1 ``--role stage1``
   workers, one consumer group), each on a fresh broker and store. The workers are started
   and warmed up (a short run stored) first; then every message is produced at once and
   the time runs from the first message produced to the last step stored. Prints the two
   rates and ``scale X`` (N-worker / 1-worker throughput).
The configuration is printed first so a result can be reproduced.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from confluent_kafka import Consumer, Producer

from probewire.deploy.settings import ClickHouseSettings, Settings, StreamSettings
from probewire.deploy.stack import LocalStack
from probewire.instrument import wire
from probewire.instrument.catalog import Group, Label, Tensor
from probewire.instrument.export import StepEmitter
from probewire.instrument.plumbing import read_heartbeat
from probewire.instrument.testing import MemoryTransport
from probewire.instrument.wire import Point, RankIdentity, decode_rank_step
from probewire.sinks.clickhouse import ClickHouseSink, connect
from probewire.stream.assemble import StepAssembler
from probewire.stream.batching import Batch
from probewire.stream.records import ReducedStep
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import RunPipeline, Stage2Config, Stage2Output
from probewire.stream.store import write_batch
from probewire.stream.testing import SimRun

TENSORS = [f"block{i}.{part}" for i in range(3) for part in ("attn", "mlp")]
FIELDS = Tensor.ALL[:7]  # the scan without its third and fourth power sums


def encode_run(run: SimRun, steps: range) -> tuple[list[list[tuple[bytes, bytes]]], int]:
    """Per step, the encoded messages of every rank; and the number of points."""
    transports = [MemoryTransport() for _ in range(run.world_size)]
    emitters = [
        StepEmitter(
            RankIdentity(
                run_id=run.run_id, rank=r, world_size=run.world_size, coords={Group.DATA.value: r}
            ),
            transports[r],
            queue_size=100_000,
        )
        for r in range(run.world_size)
    ]
    points = 0
    rng = np.random.default_rng(0)
    for step in steps:
        for rank, emitter in enumerate(emitters):
            values = [Point(n, v) for n, v in run.components(step, rank).items()]
            values += [
                Point(name, float(rng.random()), ((Label.KIND, "fwd"), (Label.TENSOR, t)))
                for t in TENSORS
                for name in FIELDS
            ]
            points += len(values)
            emitter.emit(step, values)
    for emitter in emitters:
        emitter.close()
    per_step = [[t.messages[i] for t in transports] for i in range(len(steps))]
    return per_step, points


def throughput(stack: LocalStack, ranks: int, steps: int) -> float:
    run = SimRun(run_id=f"bench-{uuid.uuid4().hex[:6]}", world_size=ranks, steps=steps)
    messages, points = encode_run(run, range(steps))
    producer = Producer({"bootstrap.servers": stack.bootstrap, "linger.ms": 20})
    for step_messages in messages:
        for key, value in step_messages:
            producer.produce("otlp_metrics", key=key, value=value)
    producer.flush(60)
    load = os.getloadavg()[0]
    stack.start_worker()
    worker = psutil.Process(stack.worker.pid)
    cpu_ready = sum(worker.cpu_times()[:2])

    def stored_at_least(n: int) -> tuple[int, float, float]:
        while (stored := stack.progress(run.run_id)) < n:
            time.sleep(0.02)
        return stored, time.perf_counter(), sum(worker.cpu_times()[:2])

    # the window runs between stored steps (10 % and 90 % of the run): neither the worker's
    # start (ready, its consumer group still forming) nor its first and last batches count
    first, t0, cpu0 = stored_at_least(steps // 10)
    # stage 1's head start, from the heartbeat (written once a second): steps it had
    # reduced when the window opened. Near ``steps``, the window measured stage 2 alone
    reduced = (
        (read_heartbeat(stack.heartbeat_path) or {})
        .get("stages", {})
        .get("stage1", {})
        .get("outputs", 0)
    )
    last, t1, cpu1 = stored_at_least(steps * 9 // 10)
    window = (last - first) * points / steps
    print(
        f"  throughput run: {ranks} ranks x {steps} steps, {points} points; steps "
        f"{first}..{last} stored in {t1 - t0:.2f}s (stage 1 had reduced ~{reduced} steps "
        f"when the window opened), worker CPU {cpu1 - cpu0:.2f}s (all threads): "
        f"{window / (cpu1 - cpu0):.0f} points per CPU-second; load average {load:.2f} at "
        f"its start"
    )
    _, _, cpu_done = stored_at_least(steps)  # every step stored before the next phase
    # the whole run's cost: stage 1 and stage 2 of every step, however far stage 1 ran
    # ahead (a faster stage 1 moves work out of the window above, not out of this figure)
    print(
        f"  whole run: {points / (cpu_done - cpu_ready):.0f} points per CPU-second (worker "
        f"CPU {cpu_done - cpu_ready:.2f}s from ready to the last step stored)"
    )
    return window / (t1 - t0)


def scale_rate(
    settings: Settings, work: Path, ranks: int, steps: int, runs: int, workers: int
) -> float:
    """points/s of ``runs`` runs through ``workers`` workers (see the module docstring)."""
    sims = [
        SimRun(run_id=f"scale{i}-{uuid.uuid4().hex[:6]}", world_size=ranks, steps=steps, seed=i)
        for i in range(runs)
    ]
    encoded = [encode_run(sim, range(steps)) for sim in sims]
    points = sum(n for _, n in encoded)
    warm = SimRun(run_id=f"warm-{uuid.uuid4().hex[:6]}", world_size=ranks, steps=20)
    with LocalStack(settings, work) as stack:
        stack.start_broker()
        stack.start_worker()
        stack.start_stage1_workers(workers - 1)
        producer = Producer(
            {"bootstrap.servers": stack.bootstrap, "linger.ms": 20, "log.connection.close": False}
        )
        for step_messages in encode_run(warm, range(warm.steps))[0]:
            for key, value in step_messages:
                producer.produce("otlp_metrics", key=key, value=value)
        producer.flush(60)
        while stack.progress(warm.run_id) < warm.steps:
            time.sleep(0.05)
        started = time.perf_counter()
        for step in range(steps):  # runs interleaved, as concurrent runs arrive
            for messages, _ in encoded:
                for key, value in messages[step]:
                    producer.produce("otlp_metrics", key=key, value=value)
                    producer.poll(0)
        producer.flush(60)
        del producer  # before the broker stops: no reconnecting to it in the meantime
        while min(stack.progress(sim.run_id) for sim in sims) < steps:
            time.sleep(0.05)
        elapsed = time.perf_counter() - started
    print(
        f"  {workers} worker(s): {runs} runs x {ranks} ranks x {steps} steps, {points} "
        f"points in {elapsed:.2f}s from the first message produced to the last step stored: "
        f"{points / elapsed:.0f} points/s"
    )
    return points / elapsed


def _cpu_us(points: int, work: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``work(*args)``'s result and its CPU time (this process, all threads: the store engine's
    too) in µs a point; the collector frozen first, so the benchmark's own heap of
    messages is not walked on the stage's time."""
    gc.collect()
    gc.freeze()
    started = time.process_time()
    out = work(*args)
    return out, (time.process_time() - started) / points * 1e6


def _decode_all(decode: Callable[..., Any], flat: list[tuple[bytes, bytes]]) -> list[Any]:
    return [decode(key, value) for key, value in flat]


def _read_steps(payloads: list[bytes]) -> list[ReducedStep]:
    return [ReducedStep.from_bytes(payload) for payload in payloads]


def _accept(pipeline: RunPipeline, items: list[ReducedStep]) -> Stage2Output:
    out = Stage2Output()
    for item in items:
        out.extend(pipeline.accept(item, time.monotonic()))
    return out


def stage1_costs(messages: list[list[tuple[bytes, bytes]]], points: int) -> list[ReducedStep]:
    """Stage 1 in this process, stage by stage (CPU µs a point), then the decode through
    the layouts stage 1 learned against field by field (µs a message); its reduced steps."""
    flat = [message for step_messages in messages for message in step_messages]
    decoded, decode_us = _cpu_us(points, _decode_all, decode_rank_step, flat)

    def reduce() -> list[ReducedStep]:
        assembler, reduced = StepAssembler(30.0), []
        for record in decoded:
            reduced += assembler.add(record, time.monotonic()).completed
        return reduced

    reduced, reduce_us = _cpu_us(points, reduce)
    _, to_bytes_us = _cpu_us(points, lambda: [r.to_bytes() for r in reduced])
    print(
        f"  stage 1 CPU us a point: decode {decode_us:.3f} reduce {reduce_us:.3f} "
        f"to_bytes {to_bytes_us:.3f}: {1e6 / (decode_us + reduce_us + to_bytes_us):.0f} "
        "points per CPU-second"
    )
    spent = {}
    for name, decode in (
        ("learned layouts", decode_rank_step),
        ("field by field", wire._decode_fields),
    ):
        _, spent[name] = _cpu_us(len(flat), _decode_all, decode, flat)
    print(
        f"  decode: {spent['learned layouts']:.1f} us a message through learned layouts, "
        f"{spent['field by field']:.1f} us field by field ({points / len(flat):.0f} points "
        "a message)"
    )
    return reduced


def stages(ranks: int, steps: int, store: Path, batches: tuple[int, ...] = (40, 200)) -> None:
    """Per-stage CPU costs of the worker's work, in this process (see the module docstring)."""
    run = SimRun(run_id="stages", world_size=ranks, steps=steps)
    messages, points = encode_run(run, range(steps))
    payloads = [r.to_bytes() for r in stage1_costs(messages, points)]
    client = connect("chdb:///" + str(store).lstrip("/"))
    for batch in batches:
        sink = ClickHouseSink(client, f"stages_{batch}", 30.0)
        sink.migrate()
        pipeline = RunPipeline(run.run_id, Settings().stream.stage2)
        cost = {"from_bytes": 0.0, "stage 2": 0.0, "store": 0.0}
        for i in range(0, len(payloads), batch):
            items, us = _cpu_us(points, _read_steps, payloads[i : i + batch])
            cost["from_bytes"] += us
            out, us = _cpu_us(points, _accept, pipeline, items)
            cost["stage 2"] += us
            state = {run.run_id: (pipeline.last_step, pipeline.to_state())}
            batched = Batch(outputs={run.run_id: out}, states=state)
            cost["store"] += _cpu_us(points, write_batch, sink, batched)[1]
        print(
            f"  stage 2 + store, {batch}-step batches, CPU us a point: "
            + " ".join(f"{name} {us:.3f}" for name, us in cost.items())
            + f": {1e6 / sum(cost.values()):.0f} points per CPU-second"
        )


def latency(stack: LocalStack, ranks: int, n_alerts: int) -> list[float]:
    every = 25
    steps = every * (n_alerts + 1)
    spikes = {every * (i + 1) for i in range(n_alerts)}
    run = SimRun(run_id=f"lat-{uuid.uuid4().hex[:6]}", world_size=ranks, steps=steps)
    run.cospike_step = None
    messages, _ = encode_run(run, range(steps))
    spiked = {}
    for step in spikes:  # re-encode the co-spike steps with spiked loss and gradient
        run.cospike_step = step
        spiked[step] = encode_run(run, range(step, step + 1))[0][0]
    run.cospike_step = None
    consumer = Consumer(
        {
            "bootstrap.servers": stack.bootstrap,
            "group.id": uuid.uuid4().hex,
            "auto.offset.reset": "latest",
            "session.timeout.ms": 6000,
            "fetch.wait.max.ms": 10,
        }
    )
    consumer.subscribe(["probewire.alerts"])
    while not consumer.assignment():  # joined: nothing published from here on is missed
        consumer.poll(0.2)
    producer = Producer({"bootstrap.servers": stack.bootstrap, "linger.ms": 0})
    sent: dict[int, float] = {}
    received: dict[int, float] = {}
    for step in range(steps):
        for key, value in spiked.get(step, messages[step]):
            producer.produce("otlp_metrics", key=key, value=value)
        producer.flush(10)
        if step in spikes:
            sent[step] = time.perf_counter()
        while (msg := consumer.poll(0.0)) is not None:
            if not msg.error():
                alert = json.loads(msg.value())
                if alert["run_id"] == run.run_id and alert["signal"] == "cospike":
                    received[alert["step"]] = time.perf_counter()
        time.sleep(0.025)
    deadline = time.monotonic() + 10
    while len(received) < len(sent) and time.monotonic() < deadline:
        msg = consumer.poll(0.2)
        if msg is not None and not msg.error():
            alert = json.loads(msg.value())
            if alert["run_id"] == run.run_id and alert["signal"] == "cospike":
                received[alert["step"]] = time.perf_counter()
    consumer.close()
    missing = sorted(set(sent) - set(received))
    if missing:
        print(f"  no alert for co-spike steps {missing}")
    return [received[s] - sent[s] for s in sorted(received) if s in sent]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--alerts", type=int, default=20)
    parser.add_argument(
        "--stages",
        action="store_true",
        help="per-stage rates in this process instead of the worker runs",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="N > 1: measure 1 worker, then N (one owner + N-1 stage1), and print scale X",
    )
    parser.add_argument("--runs", type=int, default=4, help="concurrent runs with --workers")
    args = parser.parse_args()
    if args.workers < 1 or args.runs < 1:
        parser.error("--workers and --runs must be >= 1")
    if args.workers > 1:
        print(
            f"config: ranks={args.ranks} steps={args.steps} runs={args.runs} "
            f"workers=1 then {args.workers} (1 owner + {args.workers - 1} stage1) "
            f"partitions={Settings().topics.partitions} broker=tansu(memory) store=chdb"
        )
        rates = {}
        with tempfile.TemporaryDirectory(prefix="pw-bench-") as tmp:
            for n in (1, args.workers):
                settings = Settings(
                    clickhouse=ClickHouseSettings(
                        url="chdb:///" + str(Path(tmp, f"store{n}")).lstrip("/")
                    ),
                    stream=StreamSettings(app_id=f"bench-{uuid.uuid4().hex[:6]}"),
                )
                rates[n] = scale_rate(
                    settings, Path(tmp, f"run{n}"), args.ranks, args.steps, args.runs, n
                )
        print(f"scale {rates[args.workers] / rates[1]:.2f}")
        return
    if args.stages:
        print(f"config: ranks={args.ranks} steps={args.steps} stages in one process, chdb")
        with tempfile.TemporaryDirectory(prefix="pw-bench-") as tmp:
            stages(args.ranks, args.steps, Path(tmp, "store"))
        return
    with tempfile.TemporaryDirectory(prefix="pw-bench-") as tmp:
        settings = Settings(
            clickhouse=ClickHouseSettings(url="chdb:///" + str(Path(tmp, "store")).lstrip("/")),
            stream=StreamSettings(
                app_id=f"bench-{uuid.uuid4().hex[:6]}",
                stage2=Stage2Config(
                    detectors=DetectorConfig(window=20, rearm_steps=10), retention_halo=10
                ),
            ),
        )
        print(
            f"config: ranks={args.ranks} steps={args.steps} alerts={args.alerts} "
            f"points/message={4 + len(TENSORS) * len(FIELDS)} broker=tansu(memory) "
            f"store=chdb worker=1 process"
        )
        with LocalStack(settings, Path(tmp, "run")) as stack:
            stack.start_broker()
            rate = throughput(stack, args.ranks, args.steps)
            print(f"{rate:.0f} points/s")
            lat = np.array(latency(stack, args.ranks, args.alerts)) * 1000
            print(
                f"latency p50 {np.percentile(lat, 50):.0f} ms p99 {np.percentile(lat, 99):.0f} ms"
                f" (n={lat.size})"
            )


if __name__ == "__main__":
    main()
