"""The update ratio rho per tensor (seeds 001 §6: RMS(dw) / (RMS(w) + eps) of each parameter
tensor), from a real training step of a multi-tensor model through the rank's probes, the
stream's reduction and the store: every tensor's rho in ``tensor_update_ratio`` and the
min / median / max over tensors (with the extreme tensors) in ``step_metrics``, each against
a float64 NumPy reference on the parameters before and after the optimizer step. The pooled
value stays, as ``update_ratio``, and differs from the per-tensor ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.wire import decode_rank_step
from probewire.sinks import ClickHouseSink
from probewire.stream.dimensions import tensor_dimensions
from probewire.stream.reduce import reduce_step
from probewire.stream.series import StepMetrics as SM
from probewire.stream.stage2 import RunPipeline, Stage2Config
from probewire.stream.view import detail_rows, p0_view

CFG = TinyConfig(seq_len=8, d_model=16, n_layer=2, n_head=2)


def train_step(monitor, model, opt, step: int, tokens, targets) -> None:
    """One instrumented step of the tiny model: per-token losses, backward, AdamW."""
    with monitor.step(step) as s:
        s.micro_batch(tokens=tokens, mask=targets != IGNORE)
        losses = F.cross_entropy(
            (logits := model(tokens)).reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            reduction="none",
        ).view_as(targets)
        s.loss(losses)
        losses.mean().backward()
        s.gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def trained():
    """One scan step of the tiny model (~20 parameter tensors): the reduced step and the
    float64 reference rho of every tensor."""
    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    transport = MemoryTransport()
    identity = RankIdentity(run_id="rho", rank=0, world_size=1, coords={"dp": 0})
    config = ProbeConfig(cadence={"scan": 1}, telemetry=False, comm=False)
    monitor = attach(model, opt, identity=identity, config=config, transport=transport)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, CFG.seq_len), generator=g)
    targets = torch.randint(0, 256, (4, CFG.seq_len), generator=g)
    train_step(monitor, model, opt, 0, tokens, targets)
    monitor.close()
    records = [decode_rank_step(k, v) for k, v in transport.messages]
    reference = {}
    for name, p in model.named_parameters():
        w, delta = before[name], p.detach().double() - before[name]
        rms_w = np.sqrt(np.mean(w.numpy() ** 2))
        reference[name] = np.sqrt(np.mean(delta.numpy() ** 2)) / (
            rms_w + 1e-12 / np.sqrt(w.numel())
        )
    return reduce_step("rho", 0, 1, records, "all_ranks"), reference


def test_min_median_max_over_tensors_and_the_extreme_tensors(trained):
    step, reference = trained
    view = p0_view(step).view
    values = np.array(list(reference.values()))
    assert len(values) >= 10 and values.max() / values.min() > 3  # a spread worth reading
    assert view[SM.update_ratio_min] == pytest.approx(values.min(), rel=1e-4)
    assert view[SM.update_ratio_median] == pytest.approx(np.median(values), rel=1e-4)
    assert view[SM.update_ratio_max] == pytest.approx(values.max(), rel=1e-4)
    assert view[SM.update_ratio_min_tensor] == min(reference, key=reference.__getitem__)
    assert view[SM.update_ratio_max_tensor] == max(reference, key=reference.__getitem__)
    pooled = view[SM.update_ratio]  # ||all dw|| / ||all w||: not any one tensor's rho
    assert values.min() < pooled < values.max()


def test_every_tensors_rho_is_in_the_store(trained, ch_client, ch_database):
    """Every tensor's rho, with the layer and role stage 2 named it with (tensor_names),
    so that rho per layer is a GROUP BY of the view."""
    step, reference = trained
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    sink.write("tensor_stats", detail_rows(step)["tensor_stats"])
    names = RunPipeline("rho", Stage2Config()).accept(step, 0.0).rows["tensor_names"]
    sink.write("tensor_names", names)
    rows = ch_client.query(
        f"SELECT tensor, update_ratio, layer, role FROM {ch_database}.tensor_update_ratio "
        "WHERE run_id = 'rho' AND step = 0 ORDER BY tensor"
    ).result_rows
    assert [r[0] for r in rows] == sorted(reference)
    for tensor, rho, layer, role in rows:
        assert rho == pytest.approx(reference[tensor], rel=1e-4), tensor
        assert (layer, role) == tensor_dimensions(tensor)[:2], tensor
    assert {r[2] for r in rows} >= {0, 1, None}  # both blocks, and tensors outside them
