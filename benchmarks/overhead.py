"""Probe overhead on the tiny demo model (CPU), measured side by side in one run.

Configuration (printed on stderr): TinyLM(TinyConfig()) — 2 layers, d=64, 4 heads,
sequence 64, byte vocabulary — AdamW, global-norm clipping at 1.0, 2 micro-batches of
4 padded rows per step (the demo's defaults), one intra-op thread (as each demo rank),
pre-built batches, a null transport that counts bytes (the broker is not measured).
Four identical model copies train on the same batches: probes off (the null monitor),
P0 every step (P1/P2 off), P0 every step + P1 every 100 steps, and that with the ring
buffer measuring P1 every 10th step (``ring_every=10``). After a warm-up, blocks
of 20 steps run for each variant in turn, so drift and noise from other processes hit all
three alike; medians keep one disturbed step from moving a figure.

``--device cuda`` runs the same variants on a GPU (``benchmarks/device.sh``): step times end
at a device synchronisation, the emitter waits on the pinned copy's event off the training
thread, and scans run on the device (compiled by default there).

Figures (stdout, one line each, machine-readable):

  p0 ratio X    median step time(P0) / median step time(off); goal <= 1.01
  p1 ratio X    amortised cost of P1 every 100 steps relative to P0 alone:
                (median unsampled step + median extra time of a P1 step / 100) / median(P0),
                both from the P0 + P1 variant; goal <= 1.005
  p1 ratio own X  the same against the P0 + P1 variant's own unsampled steps: 1 + median
                extra time of a P1 step / 100 / median unsampled step. Those steps run P0's
                code, so ``p1 ratio`` adds to this the difference between two model copies'
                medians, which moved by -2.2 to +0.4 % between runs (noise)
  scan ratio X  worst over 1M..64M float32 elements of scan(x) / x.abs().max(), each the
                fastest of 5-200 calls (``_best``), with the monitor's chunk size; goal <= 1.3
  scan ratio compiled X  the same for the compiled one-pass scan (scan_backend="compiled",
                the default on CUDA); the compile itself is not timed
  ring ratio X  amortised cost of the ring buffer (``ring_every`` 10: the scan tier
                measured for the ring on every 10th step, sent only on a dump) on top of
                P0 + P1: (median step of the ring variant off its held steps + median
                extra time of a held step / 10) / median unsampled step of P0 + P1
  ring step X   a held step's time over the ring variant's other steps (what
                ``ring_every`` 1 would cost per step)
  emit_us X     training-thread time per step to seal and enqueue a P0 step (the device
                gather + hand-off; probe arithmetic is in the ratios); goal <= 50
  p0 ratio gpt X  the p0 ratio on an independent model with a ~80-100 ms step (``StockGPT``:
                torch's own transformer layers, d=128, 4 layers, sequence 128); goal <= 1.01
  p0 ratio gpt compiled X  the same with ``scan_backend="compiled"`` (the gradient groups'
                scans in one compiled pass each; the default on a GPU)
  p0 ratio 1k tensors X  the p0 ratio on a model of 1,000 small parameter tensors (250 x
                Linear(32, 32) + LayerNorm(32), SGD, a ~20 ms step): the probes' per-tensor
                Python (the gradient probe's passes over the parameters), which the tiny
                model's 21 tensors hide; goal <= 1.01
  p0 ratio fsdp2 1k tensors X  the same model and ratio under FSDP2 (``fully_shard`` on a
                one-rank gloo group, CPU only): DTensor gradients, whose per-tensor Python
                (``to_local``, the sharded norm) costs more; goal <= 1.01
  ddp ratio X   the P0 step-time ratio on 4 gloo DDP ranks (each rank trains an unmonitored
                and a monitored DDP copy in alternating blocks); goal <= 1.01
  ddp emit_us X the emit cost per step on those ranks, worst rank's mean; goal <= 50
  ddp emit_us median X  the worst rank's median emit: the mean less the rare steps whose
                emit the host's scheduler preempted (4 ranks on few cores: milliseconds)

``--tensors`` runs instead the step tier's cost against the number of parameter tensors
(``benchmarks/tensorcost.py``, whose docstring defines its lines): for 10, 100 and 1,000
tensors, ``tensors N train_cpu_us X emitter_cpu_us Y p0_ops Z`` — the training thread's
and the emitter thread's CPU a step (thread CPU clocks, not wall time) and the aten::
operations the P0 tier launches a step (``torch.profiler``) — then ``flat train_cpu_us R``
and ``flat p0_ops R``, 1,000 tensors over 10; goal <= 1.3.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from probewire.deploy.demo.data import SOURCES, load_corpus
from probewire.deploy.demo.model import IGNORE, VOCAB, TinyConfig, TinyLM
from probewire.deploy.stack import free_port
from probewire.instrument import NullTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.scan import fused_scan, scan

WARMUP_STEPS = 60
BLOCK_STEPS = 20
BLOCKS = 40  # 800 steps per variant: 8 sampled P1 steps
RING = 10  # the ring variant's ring_every
SCAN_SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)


DEVICE = torch.device("cpu")  # --device cuda (benchmarks/device.sh) moves the runs to a GPU


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # step times end where the device finished the step


def _timed_steps(
    model, optimizer, monitor, batches, state: dict, steps: int, emits: list[float] | None = None
) -> list[float]:
    """``steps`` monitored training steps from ``state["step"]``; each one's wall time
    (and, given ``emits``, each one's emit time appended to it)."""
    times = []
    for _ in range(steps):
        emitted = monitor.emit_time_s
        step = state["step"]
        micro = batches[step % len(batches)]
        n_valid = sum(int(b.targets.ne(IGNORE).sum()) for b in micro)
        t0 = time.perf_counter()
        with monitor.step(step) as s:
            for b in micro:
                s.micro_batch(tokens=b.tokens, mask=b.targets != IGNORE, source=b.source)
                logits = model(b.tokens)
                losses = F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    b.targets.reshape(-1),
                    ignore_index=IGNORE,
                    reduction="none",
                ).view_as(b.targets)
                s.loss(losses)
                (losses.sum() / n_valid).backward()
            s.clip_grad_norm_(model.parameters(), 1.0)  # measures, then clips
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _sync()
        times.append(time.perf_counter() - t0)
        if emits is not None:
            emits.append(monitor.emit_time_s - emitted)
        state["step"] += 1
    return times


def _variant(name: str, config: ProbeConfig | None, batches, seed: int = 0):
    torch.manual_seed(seed)
    cfg = TinyConfig()
    model = TinyLM(cfg).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    identity = RankIdentity(run_id=f"bench-{name}", rank=0, world_size=1)
    transport = NullTransport()
    monitor = attach(
        model,
        optimizer,
        identity=identity,
        config=config or ProbeConfig(enabled=False),
        transport=transport,
    )
    state = {"step": 0}

    def run(steps: int) -> list[float]:
        return _timed_steps(model, optimizer, monitor, batches, state, steps)

    return run, monitor, transport


def _best(fn, at_least: int = 5, budget_s: float = 0.25, at_most: int = 200) -> float:
    """The fastest of at least ``at_least`` timed calls, more while they took under
    ``budget_s`` together (at most ``at_most``): a 0.3 ms call gets ~200 tries, a 30 ms one
    eight, so one disturbed call at the small sizes does not decide the ratio."""
    fn()
    _sync()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < at_least or (spent < budget_s and calls < at_most):
        t0 = time.perf_counter()
        fn()
        _sync()
        took = time.perf_counter() - t0
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def scan_ratio(chunk: int | None, compiled: bool = False) -> tuple[float, dict[int, float]]:
    ratios = {n: _scan_ratio_at(n, chunk, compiled) for n in SCAN_SIZES}
    return max(ratios.values()), ratios


def _scan_ratio_at(n: int, chunk: int | None, compiled: bool) -> float:
    """The scan's time over ``x.abs().max()``'s on one random tensor of ``n`` elements (freed
    on return, before the next size is allocated)."""
    x = torch.randn(n, device=DEVICE)
    reference = _best(lambda: x.abs().max())
    ours = _best((lambda: fused_scan(x)) if compiled else (lambda: scan(x, chunk_elems=chunk)))
    return ours / reference


def _on_device(batch):
    import dataclasses

    if DEVICE.type == "cpu":
        return batch
    return dataclasses.replace(
        batch,
        **{
            f.name: getattr(batch, f.name).to(DEVICE)
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        },
    )


class StockGPT(torch.nn.Module):
    """An independent model for the ``p0 ratio gpt`` line: a causal byte-level LM from
    torch's own ``TransformerEncoderLayer`` (pre-norm, GELU), tied head, d=128, 4 layers,
    4 heads, sequence 128, two micro-batches of 4 rows — a step of ~80-100 ms on one CPU
    thread, where the probes' fixed per-step cost weighs as on a small real run."""

    def __init__(
        self, vocab: int = VOCAB, d: int = 128, layers: int = 4, heads: int = 4, seq: int = 128
    ) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(seq, d)
        layer = torch.nn.TransformerEncoderLayer(
            d, heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer(
            "causal", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(t, device=tokens.device))
        x = self.blocks(x, mask=self.causal[:t, :t], is_causal=True)
        return self.head(self.norm(x))


GPT_SEQ = 128
GPT_BLOCKS = 16
GPT_BLOCK_STEPS = 5


def gpt_ratios(corpus, common: dict) -> tuple[float, float, float]:
    """(P0 / off, P0 with the compiled scan backend / off, median off step in s) of median
    step times on ``StockGPT``, blocks interleaved; the compile runs in the warm-up."""
    rng = np.random.default_rng(1)
    batches = [
        [_on_device(corpus.batch(rng, 4, GPT_SEQ, min_len=32)) for _ in range(2)] for _ in range(10)
    ]
    p0 = dict(cadence={"step": 1, "scan": 0, "demand": 0}, **common)
    runs = {}
    for name, config in (
        ("off", None),
        ("p0", ProbeConfig(**p0, scan_backend="eager")),
        ("compiled", ProbeConfig(**p0, scan_backend="compiled")),
    ):
        torch.manual_seed(0)
        model = StockGPT(seq=GPT_SEQ).to(DEVICE)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        monitor = attach(
            model,
            optimizer,
            identity=RankIdentity(run_id=f"gpt-{name}", rank=0, world_size=1),
            config=config or ProbeConfig(enabled=False),
            transport=NullTransport(),
        )
        state = {"step": 0}
        runs[name] = (
            lambda steps, m=model, o=optimizer, mon=monitor, st=state: _timed_steps(
                m, o, mon, batches, st, steps
            ),
            monitor,
        )
    for run, _ in runs.values():
        run(3)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(GPT_BLOCKS):
        for name, (run, _) in runs.items():
            times[name] += run(GPT_BLOCK_STEPS)
    for _, monitor in runs.values():
        monitor.close()
    off = statistics.median(times["off"])
    return (statistics.median(times["p0"]) / off, statistics.median(times["compiled"]) / off, off)


MANY_BLOCKS = 250  # Linear + LayerNorm each: 1,000 parameter tensors
MANY_ROUNDS = 40


def many_tensors_ratio(mesh=None) -> tuple[float, float]:
    """(P0 / off of median step times, median off step in s) on ``MANY_BLOCKS`` x
    (Linear(32, 32), LayerNorm(32)) with SGD, blocks of 10 steps interleaved; with a
    ``mesh``, each model is ``fully_shard``-ed on it (FSDP2: DTensor parameters and
    gradients)."""
    x = torch.randn(8, 32, device=DEVICE)
    runs = {}
    for name, config in (
        ("off", None),
        ("p0", ProbeConfig(cadence={"step": 1, "scan": 0, "demand": 0}, clip_threshold=1.0)),
    ):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *(
                layer
                for _ in range(MANY_BLOCKS)
                for layer in (torch.nn.Linear(32, 32), torch.nn.LayerNorm(32))
            )
        ).to(DEVICE)
        if mesh is not None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        monitor = attach(
            model,
            optimizer,
            identity=RankIdentity(run_id=f"many-{name}", rank=0, world_size=1),
            config=config or ProbeConfig(enabled=False),
            transport=NullTransport(),
            mesh=mesh,
        )
        runs[name] = (model, optimizer, monitor, {"step": 0})

    def run(name: str, steps: int) -> list[float]:
        model, optimizer, monitor, state = runs[name]
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            with monitor.step(state["step"]) as s:
                loss = model(x).pow(2).mean()
                s.loss_totals(loss.detach() * x.shape[0], x.shape[0])
                loss.backward()
                s.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            _sync()
            times.append(time.perf_counter() - t0)
            state["step"] += 1
        return times

    for name in runs:
        run(name, 20)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(MANY_ROUNDS):
        for name in runs:
            times[name] += run(name, 10)
    for _, _, monitor, _ in runs.values():
        monitor.close()
    off = statistics.median(times["off"])
    return statistics.median(times["p0"]) / off, off


def fsdp_many_tensors_ratio() -> tuple[float, float]:
    """``many_tensors_ratio`` under FSDP2 on a one-rank gloo group (CPU)."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return many_tensors_ratio(init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)))
    finally:
        dist.destroy_process_group()


DDP_RANKS = 4
DDP_BLOCKS = 12


def _ddp_rank(rank: int, port: int, out: str) -> None:
    """One of 4 gloo DDP ranks: an unmonitored and a P0-monitored copy, alternating blocks."""
    import json
    import os

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=DDP_RANKS)
    corpus = load_corpus()
    rng = np.random.default_rng(rank)
    cfg = TinyConfig()
    batches = [[corpus.batch(rng, 4, cfg.seq_len, min_len=8) for _ in range(2)] for _ in range(20)]
    runs, monitors = {}, {}
    for name, config in (
        ("off", None),
        (
            "p0",
            ProbeConfig(
                cadence={"step": 1, "scan": 0, "demand": 0}, clip_threshold=1.0, sources=SOURCES
            ),
        ),
    ):
        torch.manual_seed(0)
        model = DistributedDataParallel(TinyLM(cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        monitor = attach(
            model,
            opt,
            config=config or ProbeConfig(enabled=False),
            identity=RankIdentity(run_id=f"ddp-{name}", rank=rank, world_size=DDP_RANKS),
            transport=NullTransport(),
        )
        monitors[name] = monitor
        runs[name] = functools.partial(_timed_steps, model, opt, monitor, batches, {"step": 0})
    for run in runs.values():
        run(20)
    times: dict[str, list[float]] = {"off": [], "p0": []}
    emits: list[float] = []
    for _ in range(DDP_BLOCKS):
        times["off"] += runs["off"](BLOCK_STEPS)
        times["p0"] += runs["p0"](BLOCK_STEPS, emits=emits)
    for monitor in monitors.values():
        monitor.close()
    emits.sort()
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "ratio": statistics.median(times["p0"]) / statistics.median(times["off"]),
                "emit_us": statistics.mean(emits) * 1e6,
                "emit_median_us": emits[len(emits) // 2] * 1e6,
                "emit_p90_us": emits[int(0.9 * len(emits))] * 1e6,
                "emit_max_us": emits[-1] * 1e6,
            }
        )
    )
    dist.destroy_process_group()


def ddp_figures() -> tuple[float, dict[str, float]]:
    """The median over 4 DDP ranks of the P0 step-time ratio, and the worst rank's emit
    figures (µs a step: mean, median, 90th percentile, max)."""
    import json
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            _ddp_rank, args=(free_port(), out), nprocs=DDP_RANKS, start_method="spawn"
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(DDP_RANKS)]
    return (
        statistics.median(r["ratio"] for r in ranks),
        {k: max(r[k] for r in ranks) for k in ranks[0] if k.startswith("emit")},
    )


def main() -> None:
    global DEVICE
    if "--tensors" in sys.argv:  # the step tier's thread CPU and op count against tensors
        import tensorcost  # benchmarks/tensorcost.py, beside this script

        tensorcost.main(sys.argv)
        return
    if "--device" in sys.argv:
        DEVICE = torch.device(sys.argv[sys.argv.index("--device") + 1])
    torch.set_num_threads(1)
    corpus = load_corpus()
    common = dict(clip_threshold=1.0, sources=SOURCES)
    _tiny_model_figures(corpus, common)
    _other_model_figures(corpus, common)


def _tiny_model_figures(corpus: Any, common: dict[str, Any]) -> None:
    """The tiny model's variants side by side (off, P0, P0 + P1, ring), then the scans:
    the p0, p1, ring, scan and emit figures."""
    rng = np.random.default_rng(0)
    cfg = TinyConfig()
    batches = [
        [_on_device(corpus.batch(rng, 4, cfg.seq_len, min_len=8)) for _ in range(2)]
        for _ in range(50)
    ]
    p0_config = ProbeConfig(cadence={"step": 1, "scan": 0, "demand": 0}, **common)
    p1_config = ProbeConfig(cadence={"step": 1, "scan": 100, "demand": 0}, **common)
    ring_config = ProbeConfig(
        cadence={"step": 1, "scan": 100, "demand": 0}, ring_every=RING, **common
    )
    off, _, _ = _variant("off", None, batches)
    p0, p0_monitor, p0_transport = _variant("p0", p0_config, batches)
    p1, p1_monitor, _ = _variant("p1", p1_config, batches)
    ring, ring_monitor, _ = _variant("ring", ring_config, batches)
    for run in (off, p0, p1, ring):
        run(WARMUP_STEPS)
    emit_before = (p0_monitor.emit_time_s, p0_monitor.emitted_steps)
    times: dict[str, list[float]] = {"off": [], "p0": [], "p1": [], "ring": []}
    for _ in range(BLOCKS):
        for name, run in (("off", off), ("p0", p0), ("p1", p1), ("ring", ring)):
            times[name] += run(BLOCK_STEPS)
    emit_s = p0_monitor.emit_time_s - emit_before[0]
    emit_n = p0_monitor.emitted_steps - emit_before[1]
    t_off, t_p0 = statistics.median(times["off"]), statistics.median(times["p0"])
    first = WARMUP_STEPS  # step numbers of the p1 variant's timed steps start here
    sampled = [t for i, t in enumerate(times["p1"]) if (first + i) % 100 == 0]
    unsampled = statistics.median(t for i, t in enumerate(times["p1"]) if (first + i) % 100)
    extra = statistics.median(t - unsampled for t in sampled)
    p1_ratio = (unsampled + extra / 100) / t_p0
    held = [t for i, t in enumerate(times["ring"]) if (first + i) % 100 and (first + i) % RING == 0]
    other = statistics.median(t for i, t in enumerate(times["ring"]) if (first + i) % RING)
    held_extra = statistics.median(t - other for t in held)
    ring_ratio = (other + held_extra / RING) / unsampled
    for monitor in (p0_monitor, p1_monitor, ring_monitor):
        monitor.close()
    worst, per_size = scan_ratio(p0_config.scan_chunk_elems)
    print(
        f"# tiny model, 1 thread, {BLOCKS} x {BLOCK_STEPS} steps per variant; median step: "
        f"off {t_off * 1e3:.2f} ms, P0 {t_p0 * 1e3:.2f} ms, P0+P1 unsampled "
        f"{unsampled * 1e3:.2f} ms, a P1 step +{extra * 1e3:.1f} ms ({len(sampled)} seen); "
        f"scan per size { {n: round(r, 2) for n, r in per_size.items()} }; P0 messages "
        f"{p0_transport.messages}, {p0_transport.bytes / max(p0_transport.messages, 1):.0f} B "
        f"each",
        file=sys.stderr,
    )
    sys.stderr.flush()
    print(f"p0 ratio {t_p0 / t_off:.4f}")
    print(f"p1 ratio {p1_ratio:.4f}")
    print(f"p1 ratio own {1 + extra / 100 / unsampled:.4f}")
    print(f"ring ratio {ring_ratio:.4f}")
    print(f"ring step {(other + held_extra) / other:.4f}")
    print(f"scan ratio {worst:.2f}")
    compiled, per_size_compiled = scan_ratio(None, compiled=True)
    print(
        f"# compiled scan per size { {n: round(r, 2) for n, r in per_size_compiled.items()} }",
        file=sys.stderr,
    )
    print(f"scan ratio compiled {compiled:.2f}")
    print(f"emit_us {emit_s / max(emit_n, 1) * 1e6:.1f}")
    sys.stdout.flush()


def _other_model_figures(corpus: Any, common: dict[str, Any]) -> None:
    """The p0 ratio on the independent models: StockGPT, 1,000 tensors, under FSDP2 and on
    DDP ranks (the last two on CPU only)."""
    gpt, gpt_compiled, gpt_off = gpt_ratios(corpus, common)
    print(
        f"# StockGPT (torch TransformerEncoderLayer, d=128, 4 layers, sequence {GPT_SEQ}), "
        f"{GPT_BLOCKS} x {GPT_BLOCK_STEPS} steps per variant; median step off "
        f"{gpt_off * 1e3:.1f} ms",
        file=sys.stderr,
    )
    print(f"p0 ratio gpt {gpt:.4f}")
    print(f"p0 ratio gpt compiled {gpt_compiled:.4f}")
    sys.stdout.flush()
    many, many_off = many_tensors_ratio()
    print(
        f"# 1,000 parameter tensors ({MANY_BLOCKS} x Linear(32, 32) + LayerNorm(32)), "
        f"{MANY_ROUNDS} x 10 steps per variant; median step off {many_off * 1e3:.1f} ms",
        file=sys.stderr,
    )
    print(f"p0 ratio 1k tensors {many:.4f}")
    sys.stdout.flush()
    if DEVICE.type != "cpu":
        return  # the FSDP2 and DDP figures are gloo ranks on CPU cores
    fsdp, fsdp_off = fsdp_many_tensors_ratio()
    print(
        f"# the same 1,000 tensors under FSDP2 (fully_shard, one gloo rank: DTensor "
        f"gradients); median step off {fsdp_off * 1e3:.1f} ms",
        file=sys.stderr,
    )
    print(f"p0 ratio fsdp2 1k tensors {fsdp:.4f}")
    sys.stdout.flush()
    ddp_ratio, ddp_emit = ddp_figures()
    print(
        f"# ddp emit per step, worst rank: p90 {ddp_emit['emit_p90_us']:.1f} us, max "
        f"{ddp_emit['emit_max_us']:.0f} us (4 ranks share the host's cores: a rank the "
        "scheduler preempts in its emit stalls for milliseconds, which moves the mean)",
        file=sys.stderr,
    )
    print(f"ddp ratio {ddp_ratio:.4f}")
    print(f"ddp emit_us {ddp_emit['emit_us']:.1f}")
    print(f"ddp emit_us median {ddp_emit['emit_median_us']:.1f}")


if __name__ == "__main__":
    main()
