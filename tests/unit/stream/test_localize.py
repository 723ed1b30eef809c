"""Explosion localisation: the walk from the output inward, per-tensor robust detectors, and
on the demo model, scaling one block's weights makes it name that block."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from probewire.deploy.demo.data import load_corpus
from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.stream.localize import (ExplosionLocator, layer_of_tensor, layer_views,
                                           locate_explosion, walk_order)
from probewire.instrument.wire import decode_rank_step


@pytest.mark.parametrize("tensor, depth, key", [
    ("head", math.inf, "output"), ("ln_f", math.inf, "output"), ("mtp.0.head", math.inf, "output"),
    ("blocks.3", 3.0, "blocks.3"), ("blocks.3.mlp.experts.1.up", 3.0, "blocks.3"),
    ("model.layers.12.self_attn.v_proj", 12.0, "model.layers.12"),
    ("transformer.h.0.attn.c_attn.v", 0.0, "transformer.h.0"),
    ("embed", -1.0, "embeddings"), ("pos", -1.0, "embeddings"),
    ("model.embed_tokens", -1.0, "embeddings"), ("transformer.wte", -1.0, "embeddings"),
])
def test_layer_of_tensor(tensor, depth, key):
    assert layer_of_tensor(tensor) == (depth, key)


def test_walk_goes_from_the_output_inward_and_views_take_the_layer_maximum():
    assert walk_order(["blocks.0", "embeddings", "blocks.10", "output", "blocks.2"]) == \
        ["output", "blocks.10", "blocks.2", "blocks.0", "embeddings"]
    views = layer_views({"blocks.1": 1.0, "blocks.1.mlp": 3.0, "head": 2.0,
                         "blocks.0.attn": math.nan})
    assert views["blocks.1"] == 3.0 and views["output"] == 2.0 and math.isnan(views["blocks.0"])


def history(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    base = {"head": 1e-2, "blocks.2": 1e-3, "blocks.2.mlp.up": 2e-4, "blocks.1": 1.2e-3,
            "blocks.1.mlp.up": 3e-4, "blocks.0": 2e-3, "embed": 5e-3}
    return [{k: v * math.exp(0.1 * rng.standard_normal()) for k, v in base.items()}
            for _ in range(steps)], base


def test_the_first_jumping_layer_from_the_output_is_named():
    past, base = history(30)
    current = dict(base)
    current["blocks.2"] = base["blocks.2"] / 8      # outward of the culprit: falls
    current["blocks.1.mlp.up"] = base["blocks.1.mlp.up"] * 5   # the culprit's internal
    current["blocks.0"] = base["blocks.0"] * 4      # inward: also jumps, but later in the walk
    found = locate_explosion(past, current)
    assert found is not None and (found.layer, found.tensor) == ("blocks.1", "blocks.1.mlp.up")
    assert found.z > 6 and found.baseline == pytest.approx(base["blocks.1.mlp.up"], rel=0.2)
    assert [layer for layer, _ in found.walked] == ["output", "blocks.2", "blocks.1"]


def test_nothing_is_named_without_a_jump_and_a_nonfinite_value_is_named_at_once():
    past, base = history(30)
    assert locate_explosion(past, dict(base)) is None
    fresh = ExplosionLocator()
    assert fresh.update({**base, "blocks.2": math.inf}).layer == "blocks.2"  # during warm-up


def train_records(model, opt, corpus, rng, steps, start=0):
    transport = MemoryTransport()
    monitor = attach(model, opt, identity=RankIdentity(run_id="l", rank=0, world_size=1),
                     config=ProbeConfig(cadence={"scan": 1}, telemetry=False, comm=False),
                     transport=transport)
    for step in range(start, start + steps):
        b = corpus.batch(rng, 4, model.cfg.seq_len, 8)
        with monitor.step(step) as s:
            s.micro_batch(tokens=b.tokens, mask=b.targets != IGNORE)
            losses = F.cross_entropy(model(b.tokens).reshape(-1, model.cfg.vocab),
                                     b.targets.reshape(-1), ignore_index=IGNORE,
                                     reduction="none").view_as(b.targets)
            s.loss(losses)
            (losses.sum() / (b.targets != IGNORE).sum()).backward()
            s.gradients()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    monitor.close()
    return [{dict(lab)["tensor"]: v for (n, lab), v in decode_rank_step(k, m).values.items()
             if n == "tensor.abs_max" and dict(lab)["kind"] == "bwd"}
            for k, m in transport.messages]


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
    state = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             rng.bit_generator.state)
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
