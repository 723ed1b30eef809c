"""On the demo model, scaling one block's weights makes explosion localisation name that
block (a scenario: it trains the model; the localisation's unit tests are in
tests/unit/instrument/test_localize.py)."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F

from probewire.deploy.demo.data import load_corpus
from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.wire import decode_rank_step
from probewire.stream.localize import ExplosionLocator


def train_records(model, opt, corpus, rng, steps, start=0):
    transport = MemoryTransport()
    monitor = attach(
        model,
        opt,
        identity=RankIdentity(run_id="l", rank=0, world_size=1),
        config=ProbeConfig(cadence={"scan": 1}, telemetry=False, comm=False),
        transport=transport,
    )
    for step in range(start, start + steps):
        b = corpus.batch(rng, 4, model.cfg.seq_len, 8)
        with monitor.step(step) as s:
            s.micro_batch(tokens=b.tokens, mask=b.targets != IGNORE)
            losses = F.cross_entropy(
                model(b.tokens).reshape(-1, model.cfg.vocab),
                b.targets.reshape(-1),
                ignore_index=IGNORE,
                reduction="none",
            ).view_as(b.targets)
            s.loss(losses)
            (losses.sum() / (b.targets != IGNORE).sum()).backward()
            s.gradients()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    monitor.close()
    return [
        {
            dict(lab)["tensor"]: v
            for (n, lab), v in decode_rank_step(k, m).values.items()
            if n == "tensor.abs_max" and dict(lab)["kind"] == "bwd"
        }
        for k, m in transport.messages
    ]


def test_scaling_one_blocks_weights_makes_localisation_name_that_block():
    """The lead's layer-explosion fault: one block's MLP output weights × 30 after a settled
    history (40 steps) of backward |g|max views (tensor probes every step). The blocks
    nearer the output see their backward maxima fall (the final norm divides the grown
    stream down); the culprit's feed-forward internals jump ~3-5× and are named first."""
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(seq_len=32, d_model=32, n_layer=4, n_head=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus, rng = load_corpus(), np.random.default_rng(0)
    locator = ExplosionLocator(window=10, min_history=5)
    for values in train_records(model, opt, corpus, rng, 40):  # a settled history
        locator.update(values)
    state = (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(opt.state_dict()),
        rng.bit_generator.state,
    )
    named = {}
    for layer in range(4):
        model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
        rng.bit_generator.state = state[2]
        trial = copy.deepcopy(locator)
        with torch.no_grad():
            model.blocks[layer].mlp.down.weight.mul_(30.0)
        [values] = train_records(model, opt, corpus, rng, 1, start=40)
        found = trial.update(values)
        named[layer] = found and found.layer
        assert found is None or found.z > 10  # measured: z 20-41 at the culprit
    assert named == {i: f"blocks.{i}" for i in range(4)}
