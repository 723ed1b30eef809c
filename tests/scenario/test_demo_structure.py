"""The demo model's structures under the probes, read the way the stream reads them:
forcing the router toward one expert moves H_norm before I crosses its threshold, and
scaling the projector down drives γ toward 0 until the stream's threshold pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probewire.deploy.demo.data import load_corpus
from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.wire import decode_rank_step
from probewire.stream.derive import expert_balance
from probewire.stream.reduce import reduce_step
from probewire.stream.signals import DetectorConfig
from probewire.stream.stage2 import p0_view


def forward_only(model, steps, batch_of, before_step, config):
    """Forward passes under the monitor (no optimizer): P0/P1 probes need no backward."""
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=RankIdentity(run_id="d", rank=0, world_size=1),
        config=config,
        transport=transport,
    )
    with torch.no_grad():
        for step in range(steps):
            before_step(step)
            b = batch_of(step)
            with monitor.step(step) as s:
                s.micro_batch(tokens=b.tokens, mask=b.targets != IGNORE)
                model(b.tokens, b.media, b.media_mask)
    monitor.close()
    return [decode_rank_step(k, v) for k, v in transport.messages]


def test_forcing_the_router_moves_h_norm_before_the_imbalance_threshold():
    """Baseline: the bias balancer converges (steps 0-44), then is frozen; steps 45-64 are the
    reference. From step 65 expert 0's selection bias grows by 0.003 per step. "Moves":
    H_norm 4 robust σ (0.6745·Δ/MAD) below its baseline median; the page: the stream's
    MaxVio > 1.0 (I > 2; the stream's default threshold is 2.0, which this slow forcing
    reaches later still)."""
    torch.manual_seed(0)
    cfg = TinyConfig(
        seq_len=32, d_model=32, n_layer=1, n_head=2, n_experts=8, top_k=2, balance_rate=0.02
    )
    model = TinyLM(cfg).train()
    moe = model.blocks[0].mlp
    corpus, rng = load_corpus(), np.random.default_rng(0)

    def before(step):
        moe.balance_rate = 0.02 if step < 30 else 0.005 if step < 45 else 0.0
        if step >= 65:
            moe.router.expert_bias[0] += 0.003

    recs = forward_only(
        model,
        95,
        lambda s: corpus.batch(rng, 32, cfg.seq_len, 8),
        before,
        ProbeConfig(cadence={"scan": 0}, telemetry=False, comm=False),
    )
    series = []
    for rec in recs:
        view, _, _ = p0_view(reduce_step("d", rec.step, 1, [rec], "complete"))
        counts = [
            rec.values[("moe.expert_tokens", (("expert", str(e)), ("layer", "0")))]
            for e in range(cfg.n_experts)
        ]
        assert expert_balance(counts).entropy_norm == pytest.approx(view["moe_h_norm"])
        series.append((rec.step, view["moe_h_norm"], view["moe_maxvio"]))
    base = np.array([h for step, h, _ in series if 45 <= step < 65])
    median = np.median(base)
    mad = np.median(np.abs(base - median))
    threshold = 1.0
    assert max(v for step, _, v in series if 45 <= step < 65) < threshold
    moved = next(step for step, h, _ in series if step >= 65 and 0.6745 * (median - h) / mad > 4)
    paged = next(step for step, _, v in series if step >= 65 and v > threshold)
    assert moved + 5 <= paged, (moved, paged)


def test_scaling_the_projector_down_drives_gamma_toward_zero_and_pages():
    torch.manual_seed(0)
    cfg = TinyConfig.preset("media", seq_len=16, d_model=16, n_head=2, encoder_dim=8)
    model = TinyLM(cfg).eval()
    corpus = load_corpus()
    fixed = corpus.batch(np.random.default_rng(0), 4, cfg.seq_len, 8, media_tiles=2)
    assert fixed.media_mask.any()

    def before(step):
        if step >= 2:  # the projector shrinks: weights and bias halve every step
            model.projector.proj.weight.mul_(0.5)
            model.projector.proj.bias.mul_(0.5)

    recs = forward_only(
        model,
        10,
        lambda s: fixed,
        before,
        ProbeConfig(cadence={"scan": 1}, telemetry=False, comm=False),
    )
    gammas = [p0_view(reduce_step("d", r.step, 1, [r], "complete"))[0]["media_scale"] for r in recs]
    assert gammas[0] == pytest.approx(gammas[1]) and gammas[0] > 0.1
    for before_, after in zip(gammas[1:], gammas[2:]):
        assert after == pytest.approx(before_ / 2, rel=1e-5)  # the media RMS halves
    paging = [r.step for r, g in zip(recs, gammas) if g < DetectorConfig().media_scale_min]
    assert paging and paging[0] > 2 and gammas[-1] < gammas[0] / 200
