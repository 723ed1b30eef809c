"""Exact on the layouts real pretraining uses: FSDP2 on 2 and 4 ranks, HSDP, 2 DP × 2 TP
with sequence parallelism, two pipeline stages, two-way expert parallelism — each trained on
real gloo process groups with probewire attached, through the real broker, worker and store.
What ClickHouse stores is held against the ranks' own numbers and an unsharded reference:
L and L_max exactly (from the ranks' float64 loss sums and counts), G2 within float32
rounding of ``clip_grad_norm_`` on the unsharded model, every gradient element counted once,
the per-expert valid-token counts of the MoE layer exactly, memory capacity and headroom.
Two more runs on the same stack: FSDP2 clipped at max_norm 0.5 with no clip_threshold (the
clip rate), and two-way expert parallelism with strided placement (the shard imbalance)."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import parallel_ranks as pr
import pytest
import torch.multiprocessing as mp

from probewire.deploy.settings import ClickHouseSettings, Settings
from probewire.deploy.stack import LocalStack
from probewire.stream.signals import DetectorConfig

pytestmark = pytest.mark.integration

LAYOUTS = tuple(pr.WORLD)

# The ranks fork from a server that imported torch, its parallel APIs and probewire once;
# spawned, each rank imported them again (~3 s of CPU each on a 2-core host).
multiprocessing.set_forkserver_preload(
    [
        "parallel_ranks",
        "probewire.instrument",
        "torch.distributed.fsdp",
        "torch.distributed.tensor.parallel",
        "torch.distributed.pipelining",
    ]
)


def _ranks(fn, args: tuple, nprocs: int) -> None:
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(scratch_module: Path, read_store):
    """Every layout trained once against one stack; then the stack stops and the store is read."""
    store = scratch_module / "store"
    settings = Settings(clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/")))
    run_ids = {layout: f"{layout}-{uuid.uuid4().hex[:6]}" for layout in pr.RUNS}
    traces: dict[str, dict[int, dict[int, dict]]] = {}
    sent: dict[str, dict[int, dict]] = {}
    with LocalStack(settings, scratch_module / "stack") as stack:
        bootstrap = stack.start_broker()
        stack.start_worker()
        for layout in pr.RUNS:
            trace_dir = scratch_module / layout
            trace_dir.mkdir()
            world = pr.RUNS[layout]
            _ranks(
                pr.train,
                (world, _port(), layout, run_ids[layout], bootstrap, str(trace_dir)),
                world,
            )
            traces[layout] = {
                r: {
                    rec["step"]: rec
                    for rec in map(
                        json.loads, (trace_dir / f"rank{r}.jsonl").read_text().splitlines()
                    )
                }
                for r in range(world)
            }
            sent[layout] = {
                r: json.loads((trace_dir / f"rank{r}.stats.json").read_text()) for r in range(world)
            }
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
            stack.progress(run_ids[layout]) < pr.steps_of(layout) for layout in pr.RUNS
        ):
            time.sleep(0.5)
    warnings = [
        line
        for line in (scratch_module / "stack" / "worker.log")
        .read_text(errors="replace")
        .splitlines()
        if "WARNING" in line or "ERROR" in line
    ]
    db = settings.clickhouse.database
    ids = ", ".join(f"'{r}'" for r in run_ids.values())
    steps = read_store(
        store,
        f"SELECT run_id, step, loss, loss_worst_rank, grad_norm, grad_clip_norm, clip_rate, clipped, "
        f"memory_capacity_bytes, memory_headroom, moe_shard_imbalance, ranks_reporting FROM {db}.step_metrics FINAL WHERE run_id IN "
        f"({ids}) ORDER BY run_id, step",
    )
    ranks = read_store(
        store,
        f"SELECT run_id, step, rank, metric, labels, value FROM "
        f"{db}.rank_metrics_recent FINAL WHERE run_id IN ({ids})",
    )
    refused = read_store(store, f"SELECT key, reason FROM {db}.dead_letters")
    alerts = read_store(
        store,
        f"SELECT run_id, step, signal, value, baseline FROM {db}.alerts FINAL "
        f"WHERE run_id IN ({ids}) ORDER BY run_id, step",
    )
    experts = read_store(
        store,
        f"SELECT run_id, step, expert, shard, tokens FROM "
        f"{db}.expert_stats_recent FINAL WHERE run_id IN ({ids})",
    )
    balance = read_store(
        store,
        f"SELECT run_id, step, layer, shard_imbalance FROM {db}.expert_balance "
        f"WHERE run_id IN ({ids})",
    )
    by_layout = {}
    for layout, run_id in run_ids.items():
        by_layout[layout] = {
            "steps": {r["step"]: r for r in steps if r["run_id"] == run_id},
            "ranks": [r for r in ranks if r["run_id"] == run_id],
            "experts": {
                (r["step"], r["expert"]): r["tokens"] for r in experts if r["run_id"] == run_id
            },
            "shards": {
                (r["step"], r["expert"]): r["shard"] for r in experts if r["run_id"] == run_id
            },
            "balance": {r["step"]: r["shard_imbalance"] for r in balance if r["run_id"] == run_id},
            "traces": traces[layout],
            "alerts": [a for a in alerts if a["run_id"] == run_id],
            # why a rank is missing: what it sent, what the worker refused or logged
            "evidence": {
                "sent": sent[layout],
                "worker": [w for w in warnings if run_id in w],
                "refused": [r["reason"] for r in refused if r["key"].startswith(run_id + ":")],
            },
        }
    return by_layout


@pytest.fixture(scope="module")
def scratch_module(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_step_is_stored_with_every_rank(runs, layout):
    rows = runs[layout]["steps"]
    assert sorted(rows) == list(range(pr.STEPS))
    reporting = {step: row["ranks_reporting"] for step, row in rows.items()}
    assert set(reporting.values()) == {pr.WORLD[layout]}, (reporting, runs[layout]["evidence"])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_and_worst_rank_loss_are_exact(runs, layout):
    """L = Σ loss sums / Σ valid tokens and L_max = max of rank means, from the loss sums
    the ranks computed themselves, counted once per data shard (tensor-parallel copies and
    pipeline stages without the loss add nothing); step 0 also against the reference."""
    for step, row in runs[layout]["steps"].items():
        parts = [t[step] for t in runs[layout]["traces"].values() if "loss_sum" in t[step]]
        shards = {(p["loss_sum"], p["tokens"]) for p in parts}  # tp replicas are one shard
        sums, counts = [s for s, _ in shards], [n for _, n in shards]
        assert row["loss"] == pytest.approx(math.fsum(sums) / sum(counts), rel=1e-12)
        worst = max(s / n for s, n in shards if n)
        assert row["loss_worst_rank"] == pytest.approx(worst, rel=1e-12)
    ref = pr.reference(layout)
    assert runs[layout]["steps"][0]["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert runs[layout]["steps"][0]["loss_worst_rank"] == pytest.approx(ref["worst"], rel=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_norm_is_the_unsharded_clip_norm(runs, layout):
    """G2 from the owners' squared sums (never a norm of norms) equals the global norm each
    rank clipped with, and at step 0 clip_grad_norm_ of the unsharded model."""
    for step, row in runs[layout]["steps"].items():
        clipped = {round(t[step]["clip_norm"], 5) for t in runs[layout]["traces"].values()}
        assert len(clipped) == 1  # every rank clipped with the same global norm
        assert row["grad_norm"] == pytest.approx(clipped.pop(), rel=1e-4)
    assert runs[layout]["steps"][0]["grad_norm"] == pytest.approx(
        pr.reference(layout)["grad_norm"], rel=1e-5
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_gradient_element_is_counted_once(runs, layout):
    """Σ over ranks of grad.elements is the model's parameter count: replicas counted once,
    shards summed. max |g| over ranks is the unsharded one."""
    rows = [r for r in runs[layout]["ranks"] if r["step"] == 0 and r["labels"] == ""]
    elements = sum(r["value"] for r in rows if r["metric"] == "grad.elements")
    peak = max(r["value"] for r in rows if r["metric"] == "grad.abs_max")
    ref = pr.reference(layout)
    assert elements == ref["elements"]
    assert peak == pytest.approx(ref["abs_max"], rel=1e-5)


def test_expert_parallel_counts_each_expert_once(runs):
    """Two expert-parallel ranks: c_i summed over the ranks' routers equals the unsharded
    router's count of valid tokens per expert."""
    ref = pr.reference("ep")["expert_counts"]
    got = [runs["ep"]["experts"][(0, i)] for i in range(pr.E)]
    assert got == ref and sum(got) == pr.K * sum(
        int(n) for n in [(pr.global_batch(0)[1] != pr.IGNORE).sum()]
    )


def test_clip_rate_counts_the_steps_over_the_max_norm_the_loop_clipped_with(runs):
    """fsdp2 clipped by ``s.clip_grad_norm_(params, 0.5)``, no ProbeConfig.clip_threshold:
    each rank sends grad.clip_threshold = 0.5 on every step, and the stored clip_rate at step
    t is the fraction of the window's steps (the last W of 0..t) whose clipping norm, as the
    ranks computed it, exceeded 0.5; clipped is that step's indicator. Every G2 lies under
    the stream's default c = 1.0 and some under 0.5, so neither default matches."""
    run, steps = runs["clip"], pr.CLIP_STEPS
    norms = np.array([run["traces"][0][t]["clip_norm"] for t in range(steps)], dtype=np.float64)
    over = norms > pr.CLIP_MAX_NORM
    assert 0 < over.sum() < steps and norms.max() < 1.0
    window = DetectorConfig().clip_window
    for t in range(steps):
        row = run["steps"][t]
        assert row["clip_rate"] == pytest.approx(over[max(0, t - window + 1) : t + 1].mean())
        assert row["clipped"] == int(over[t])
    sent = [r["value"] for r in run["ranks"] if r["metric"] == "grad.clip_threshold"]
    assert sent == [pr.CLIP_MAX_NORM] * (pr.RUNS["clip"] * steps)


@pytest.mark.parametrize(
    "layout,owner", [("ep", lambda i: i // 2), ("ep_strided", lambda i: i % 2)]
)
def test_shard_imbalance_under_two_way_ep_follows_the_expert_placement(runs, layout, owner):
    """Two expert-parallel ranks holding experts {0, 1} | {2, 3} (contiguous) or {0, 2} |
    {1, 3} (strided, as ``local_expert_indices`` says): each expert is stored with the shard
    that holds it, and step_metrics.moe_shard_imbalance and expert_balance.shard_imbalance
    both equal max_s C_s / mean_s C_s over the true placement, from the unsharded router's
    counts at step 0 and the stored counts after (float64 NumPy); at step 0 the two
    placements give different values, so a contiguous assumption fails the strided run."""
    run = runs[layout]
    ref = np.array(pr.reference("ep")["expert_counts"], dtype=np.float64)
    owners = np.array([owner(i) for i in range(pr.E)])
    for step in range(pr.STEPS):
        assert [run["shards"][(step, i)] for i in range(pr.E)] == owners.tolist()
        counts = np.array([run["experts"][(step, i)] for i in range(pr.E)], dtype=np.float64)
        if step == 0:
            assert counts.tolist() == ref.tolist()
        loads = np.bincount(owners, weights=counts)
        want = loads.max() / loads.mean()
        assert run["steps"][step]["moe_shard_imbalance"] == pytest.approx(want, rel=1e-12)
        assert run["balance"][step] == pytest.approx(want, rel=1e-12)
    contiguous, strided = (
        np.bincount([o(i) for i in range(pr.E)], weights=ref)
        for o in (lambda i: i // 2, lambda i: i % 2)
    )
    assert contiguous.max() / contiguous.mean() != pytest.approx(strided.max() / strided.mean())


def _cpu_capacity() -> float:
    """This host's memory limit as the test reads it: the cgroup's (v2, else v1), never
    above physical memory."""
    physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = Path(path).read_text().strip() if Path(path).exists() else ""
        if text.isdigit():
            return min(float(text), physical)
    return physical


@pytest.mark.parametrize("layout", tuple(pr.RUNS))
def test_memory_capacity_and_headroom_are_stored_every_step(runs, layout):
    """CPU ranks send their capacity (cgroup or physical limit) every step: the stored
    memory_capacity_bytes is it, and memory_headroom = min over ranks of 1 - peak_rss_r /
    capacity, from the peaks the ranks sent (float64 NumPy)."""
    capacity = _cpu_capacity()
    peaks: dict[int, dict[int, float]] = {}
    for r in runs[layout]["ranks"]:
        if r["metric"] == "memory.peak_rss" and r["labels"] == "":
            peaks.setdefault(r["step"], {})[r["rank"]] = r["value"]
    assert sorted(peaks) == sorted(runs[layout]["steps"])
    for step, row in runs[layout]["steps"].items():
        rss = np.array(list(peaks[step].values()), dtype=np.float64)
        assert len(rss) == pr.RUNS[layout]
        assert row["memory_capacity_bytes"] == capacity
        assert row["memory_headroom"] == pytest.approx(np.min(1.0 - rss / capacity), rel=1e-12)
        assert 0.0 < row["memory_headroom"] < 1.0


@pytest.mark.parametrize("case,name", [("plain_shard", "head.weight"), ("fsdp", "embed.weight")])
def test_a_shard_declared_a_replica_is_refused_naming_the_parameter(tmp_path, case, name):
    """The old failure mode: shards taken for DDP replicas would keep only dp=0's part.
    Declared by hand against what the model is, attach refuses in one line instead."""
    _ranks(pr.refused, (2, _port(), case, str(tmp_path)), 2)
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert f"parameter {name!r}" in message and "\n" not in message
        assert "sharded" in message and ("dp_replicated" in message)


def test_the_grad_norm_audit_pages_a_loop_that_norms_its_local_shard_and_no_global_norm(runs):
    """FSDP2 whose loop computes its own clipping norm and reports it (``s.clipped``): the
    local shard's norm pages grad_norm_audit on every step's first event with both values;
    the global one (``full_tensor()``) equals G2 and pages nothing, nor do the layouts that
    report a global norm of their own (pipeline, expert parallel)."""
    local = runs["audit_local"]
    audits = [a for a in local["alerts"] if a["signal"] == "grad_norm_audit"]
    assert [a["step"] for a in audits] == [0], local["alerts"]
    row = local["steps"][0]
    assert (audits[0]["value"], audits[0]["baseline"]) == (row["grad_clip_norm"], row["grad_norm"])
    own = max(local["traces"][r][0]["clip_norm"] for r in local["traces"])  # reduction: max
    assert row["grad_clip_norm"] == pytest.approx(own, rel=1e-6)
    assert row["grad_clip_norm"] < 0.99 * row["grad_norm"]
    good = runs["audit_fsdp2"]
    assert good["alerts"] == []
    for step, r in good["steps"].items():
        assert r["grad_clip_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), step
    for layout in ("pp", "ep", "ep_strided", *LAYOUTS):
        assert not [a for a in runs[layout]["alerts"] if a["signal"] == "grad_norm_audit"], layout
