"""Discovery on real architectures: Hugging Face Llama, Mixtral and GPT-2 built offline from
tiny configs with random weights. Each trains a few steps under ``attach`` and must report
every catalog observation point the architecture has, with finite values, registered once
and with no change to the model code. Also the demo model's presets."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download

import pytest
import torch
import torch.nn.functional as F

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.instrument import CATALOG, MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.discover import discover
from probewire.instrument.structure_config import StructureConfig
from probewire.instrument.wire import decode_rank_step

transformers = pytest.importorskip("transformers")

IGNORE = -100
ROWS, LENGTH, VOCAB, BOS_ID = 3, 10, 64, 1
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    bos_token_id=BOS_ID,
    eos_token_id=2,
    pad_token_id=0,
)
BLOCK_ROLES = {"q", "k", "v", "o", "norm_attn", "norm_mlp"}


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))


def mixtral():
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    )


def gpt2():
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=32,
            bos_token_id=BOS_ID,
            eos_token_id=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


# architecture -> (roles per block, model-level roles, has experts)
ARCHS = {
    "llama": (
        llama,
        BLOCK_ROLES | {"mlp_gate", "mlp_up", "mlp_down"},
        {"embedding", "output", "norm_final"},
        False,
    ),
    "mixtral": (
        mixtral,
        BLOCK_ROLES | {"router", "expert_gate", "expert_up", "expert_down"},
        {"embedding", "output", "norm_final"},
        True,
    ),
    "gpt2": (
        gpt2,
        BLOCK_ROLES | {"mlp_up", "mlp_down"},
        {"embedding", "norm_final"},
        False,
    ),  # lm_head is tied to wte: one view
}


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=g)
    ids[:, 0] = BOS_ID
    lengths = torch.tensor([LENGTH, LENGTH - 3, 5])
    attention = torch.arange(LENGTH)[None, :] < lengths[:, None]
    ids = torch.where(attention, ids, 0)
    targets = torch.full_like(ids, IGNORE)
    targets[:, :-1] = torch.where(attention[:, 1:], ids[:, 1:], IGNORE)
    return ids, attention, targets


def train(model, steps: int = 3, grads: dict | None = None):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    transport = MemoryTransport()
    config = ProbeConfig(cadence={"step": 1, "scan": 1, "demand": 1}, telemetry=False, comm=False)
    monitor = attach(
        model,
        opt,
        identity=RankIdentity(run_id="hf", rank=0, world_size=1),
        config=config,
        transport=transport,
    )
    hooks = []
    for step in range(steps):
        ids, attention, targets = batch(step)
        with monitor.step(step) as s:
            mask = targets != IGNORE
            s.micro_batch(tokens=ids, mask=mask)
            logits = model(input_ids=ids, attention_mask=attention.long()).logits
            losses = F.cross_entropy(
                logits.reshape(-1, VOCAB),
                targets.reshape(-1),
                ignore_index=IGNORE,
                reduction="none",
            ).view_as(targets)
            s.loss(losses)
            (losses.sum() / mask.sum()).backward()
            s.gradients()
            if grads is not None:  # what the probe read: accumulated, before clipping
                grads.update(
                    {
                        n: p.grad.detach().double().clone()
                        for n, p in model.named_parameters()
                        if p.grad is not None
                    }
                )
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        hooks.append(
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
        )
    monitor.close()
    return [decode_rank_step(k, v) for k, v in transport.messages], hooks, mask


def labelled(rec, name):
    return [dict(labels) for (n, labels) in rec.values if n == name]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_real_architecture_reports_every_observation_point_it_has(arch):
    build, block_roles, model_roles, experts = ARCHS[arch]
    torch.manual_seed(0)
    model = build()
    found = discover(model, StructureConfig())
    assert len(found.blocks) == 2 and all(
        b.attn is not None and b.mlp is not None for b in found.blocks
    )
    assert len(found.values) == 2 and found.bos_id == BOS_ID
    assert len(found.routers) == (2 if experts else 0)
    recs, hooks, mask = train(model)
    assert len(set(hooks)) == 1  # registered once at attach; nothing added per step
    rec = recs[-1]
    for name, value in rec.values.items():
        assert name[0] in CATALOG
        assert math.isfinite(value), name
    # residual paths: every block, both branches, every statistic
    branches = {(d["layer"], d["branch"]) for d in labelled(rec, "residual.tokens")}
    assert branches == {(str(i), b) for i in range(2) for b in ("attn", "mlp")}
    for stem in ("ratio", "stream_norm", "branch_norm", "importance", "angle", "noop"):
        for field in ("sum", "p90", "p99", "max"):
            assert len(labelled(rec, f"residual.{stem}_{field}")) == 4
    assert rec.values[("residual.tokens", (("branch", "attn"), ("layer", "0")))] == mask.sum()
    # BOS value gradient (one valid BOS per row) and its reference, per layer
    for name in (
        "attn.bos_value_grad_sum_sq",
        "attn.bos_value_grad_n",
        "attn.bos_value_grad_abs_max",
        "attn.value_grad_sum_sq",
        "attn.value_grad_n",
    ):
        assert {d["layer"] for d in labelled(rec, name)} == {"0", "1"}, name
    # per-module views (P2)
    roles = {(d.get("layer"), d["module"]) for d in labelled(rec, "module.grad_sum_sq")}
    assert roles == {(str(i), r) for i in range(2) for r in block_roles} | {
        (None, r) for r in model_roles
    }
    assert {(d["layer"], d["module"]) for d in labelled(rec, "module.act_sum_sq")} == {
        ("0", "attn_core"),
        ("1", "attn_core"),
    }
    # experts: per-expert counts from the router outputs (transformers 5 fuses the experts)
    counts = labelled(rec, "moe.expert_tokens")
    if experts:
        for layer in ("0", "1"):
            total = sum(
                v
                for (n, lab), v in rec.values.items()
                if n == "moe.expert_tokens" and dict(lab)["layer"] == layer
            )
            assert total == 2 * mask.sum()  # top-2, padding excluded
        assert {d["expert"] for d in counts} == {"0", "1", "2", "3"}
        assert len(labelled(rec, "moe.topk_margin_p99")) == 2
    else:
        assert not counts
    # no media path, no MTP, no gates in these architectures: nothing of theirs is sent
    assert not [
        n for n, _ in rec.values if n.startswith(("modality.", "output.mtp", "residual.gate"))
    ]


@pytest.mark.parametrize("preset", ["tiny", "moe", "media", "full"])
def test_demo_presets_are_discovered(preset):
    cfg = TinyConfig.preset(preset, seq_len=8, d_model=16, n_head=2, encoder_dim=8)
    points = discover(TinyLM(cfg), StructureConfig()).points()
    assert points["blocks"] == ["blocks.0", "blocks.1"]
    assert len(points["values"]) == 2
    assert len(points["routers"]) == (2 if cfg.n_experts else 0)
    assert len(points["gates"]) == (4 if cfg.gated_branches else 0)
    assert points["projector"] == (["projector"] if cfg.media_tiles else [])
    assert points["mtp"] == (["mtp.0"] if cfg.mtp_depth else [])
    assert ("0:gate_score" in points["activations"]) == cfg.attn_gate


def test_structure_probes_can_be_switched_off():
    model = TinyLM(TinyConfig.preset("full", seq_len=8, d_model=16, n_head=2, encoder_dim=8))
    monitor = attach(
        model,
        None,
        identity=RankIdentity(run_id="x", rank=0, world_size=1),
        transport=MemoryTransport(),
        config=ProbeConfig(structure=StructureConfig(enabled=False), telemetry=False, comm=False),
    )
    assert monitor.structure is None
    monitor.close()


@pytest.mark.parametrize(
    "arch, fused, parts",
    [
        (
            "gpt2",
            "transformer.h.1.attn.c_attn.weight",
            {"q": 0, "k": 1, "v": 2},
        ),  # Conv1D [in, out]
        ("mixtral", "model.layers.1.mlp.experts.gate_up_proj", {"expert_gate": 0, "expert_up": 1}),
    ],
)
def test_fused_weights_are_split_along_their_output_features(arch, fused, parts):
    torch.manual_seed(0)
    grads: dict = {}
    recs, _, _ = train(ARCHS[arch][0](), steps=1, grads=grads)
    g = grads[fused]
    pieces = g.chunk(len(parts), dim=1)  # Conv1D and stacked experts keep outputs on dim 1
    for role, i in parts.items():
        key = ("module.grad_sum_sq", (("layer", "1"), ("module", role)))
        assert recs[0].values[key] == pytest.approx(float((pieces[i] ** 2).sum()), rel=1e-5)
        key = ("module.grad_abs_max", (("layer", "1"), ("module", role)))
        assert recs[0].values[key] == pytest.approx(float(pieces[i].abs().max()), rel=1e-6)
