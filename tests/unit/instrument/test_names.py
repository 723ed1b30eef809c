"""The catalog is the only source of names: no module spells a metric name itself, every
reference to a catalog constant exists, and every name any probe emits is in the catalog
(with the labels its entry allows), so a typo fails here instead of dead-lettering a
rank's message in production."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import probewire.instrument.catalog as catalog
from probewire.deploy.demo.model import BOS, IGNORE, TinyConfig, TinyLM, mtp_targets
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, StructureConfig, attach
from probewire.instrument.catalog import CATALOG, NAMESPACES
from probewire.instrument.wire import decode_rank_step

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("instrument", "stream", "sinks", "deploy", "evaluators", "benchmarks")
NAMES = set(CATALOG)


def sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_no_module_spells_a_metric_name_itself():
    spelled = []
    for path in sources():
        if path == ROOT / "instrument" / "catalog.py":
            continue
        names = NAMES
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                spelled.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not spelled, "use the catalog's constant instead:\n" + "\n".join(spelled)


def test_every_catalog_constant_a_module_uses_exists():
    spaces = {ns.__name__: ns for ns in (*NAMESPACES, catalog.Label)}
    missing = []
    for path in sources():
        tree = ast.parse(path.read_text(), str(path))
        imported = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("catalog")
            for alias in node.names
            if alias.name in spaces
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in imported
                and not hasattr(spaces[node.value.id], node.attr)
            ):
                missing.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.id}.{node.attr}"
                )
    assert not missing, "\n".join(missing)


def test_a_misspelt_constant_is_caught(tmp_path, monkeypatch):
    """The check above is not vacuous: a module using Loss.SUMM is reported."""
    bad = ROOT / "instrument" / "_misspelt_for_test.py"
    bad.write_text("from .catalog import Loss\nNAME = Loss.SUMM\n")
    try:
        with pytest.raises(AssertionError, match=r"Loss\.SUMM"):
            test_every_catalog_constant_a_module_uses_exists()
    finally:
        bad.unlink()


# ------------------------------------------------------------------ what probes emit
# Metrics this machine cannot produce: CUDA allocator and NVML readings, and the pressure
# file of kernels without PSI. Everything else in the catalog must be emitted below.
NEEDS_CUDA = {
    "memory.peak_allocated",
    "memory.peak_reserved",
    "memory.allocated",
    "memory.reserved",
    "device.utilization",
    "device.memory_used",
    "device.power",
    "device.temperature",
    "device.clock_mhz",
}
OPTIONAL = {"host.cpu_pressure"} if not Path("/proc/pressure/cpu").exists() else set()


def test_every_name_every_probe_emits_is_in_the_catalog_and_every_entry_is_emitted(gloo_world):
    cfg = TinyConfig.preset("full", seq_len=12, d_model=16, n_head=2, n_experts=4, encoder_dim=8)
    torch.manual_seed(0)
    model = TinyLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    transport = MemoryTransport()
    monitor = attach(
        model,
        opt,
        identity=RankIdentity(run_id="names", rank=0, world_size=1, coords={"dp": 0, "ep": 0}),
        transport=transport,
        config=ProbeConfig(
            cadence={"step": 1, "scan": 1, "demand": 1},
            clip_threshold=1.0,
            sources=("web", "code"),
            modalities=("image",),
            structure=StructureConfig(bos_id=BOS),
        ),
    )
    g = torch.Generator().manual_seed(1)
    rows, t = 3, cfg.seq_len
    for step in range(2):
        with monitor.step(step) as s:
            targets = torch.randint(0, 256, (rows, t), generator=g)
            targets[0, t // 2 :] = IGNORE
            tokens = torch.full((rows, t), BOS)
            tokens[:, 1:] = targets[:, :-1].clamp(min=0)
            media = torch.rand(rows, cfg.media_tiles, cfg.image_size, cfg.image_size, generator=g)
            present = torch.tensor([[True, True], [True, False], [False, False]])
            s.micro_batch(tokens=tokens, mask=targets != IGNORE, source=torch.tensor([0, 1, 0]))
            logits, mtp = model(tokens, media, present, return_mtp=True)
            losses = F.cross_entropy(
                logits.float().transpose(1, 2), targets, ignore_index=IGNORE, reduction="none"
            )
            s.loss(losses, modality=torch.full((rows,), 0))
            mtp_loss = sum(
                F.cross_entropy(
                    z.float().transpose(1, 2), mtp_targets(targets, k), ignore_index=IGNORE
                )
                for k, z in enumerate(mtp, 1)
            )
            (losses.sum() + mtp_loss).backward()
            dist.all_reduce(torch.ones(3))
            s.comm_wait("ddp_allreduce", 0.01)
            s.skipped()
            s.replayed(reproduced=False)
            for reduction in ("mean", "sum", "max", "rank0"):
                s.log(f"own_{reduction}", float(step), reduction)
            if step == 0:
                s.clip_grad_norm_(model.parameters(), 1.0)
            else:  # the loop's own clipping norm: sent for the stream's audit
                s.gradients()
                s.clipped(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
            opt.step()
            opt.zero_grad()
    monitor.close()
    emitted = set()
    for key, value in transport.messages:
        record = decode_rank_step(key, value)  # checks every name and label key against the catalog
        emitted |= {name for name, _ in record.values}
    assert emitted <= set(CATALOG)
    never = set(CATALOG) - emitted - NEEDS_CUDA - OPTIONAL
    assert not never, f"catalog entries no probe emitted: {sorted(never)}"
