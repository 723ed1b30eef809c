"""Observation points and the parameter table decided at attach time."""

from __future__ import annotations

import pytest
from torch import nn

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.instrument.catalog import GRAD_GROUPS
from probewire.instrument.config import ProbeConfig
from probewire.instrument.registry import build_registry, label_name
from probewire.instrument.wire import RankIdentity


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 10)


def ident(**coords: int) -> RankIdentity:
    return RankIdentity(run_id="r", rank=0, world_size=8, coords=coords)


@pytest.mark.parametrize(
    "raw,clean",
    [
        ("module.blocks.0.attn", "blocks.0.attn"),
        ("_orig_mod.module.head", "head"),
        ("blocks.1._checkpoint_wrapped_module.mlp", "blocks.1.mlp"),
        ("layers.0._fsdp_wrapped_module.self_attn", "layers.0.self_attn"),
        ("", ""),
    ],
)
def test_label_names_drop_wrapper_components(raw, clean):
    assert label_name(raw) == clean


def test_default_patterns_find_the_seeds_observation_points_in_the_demo_model():
    registry = build_registry(TinyLM(TinyConfig(n_layer=1)), ProbeConfig(), ident(dp=0))
    names = {m.name for m in registry.modules}
    assert names == {
        "embed",
        "pos",
        "blocks.0",
        "blocks.0.attn",
        "blocks.0.attn.qkv",
        "blocks.0.mlp",
        "blocks.0.mlp.up",
        "head",
    }
    assert registry.logits is not None and registry.logits.name == "head"
    assert registry.whole_gradient


def test_parameter_groups_fused_splits_and_ownership():
    config = ProbeConfig(tp_replicated=(r"norm(\..*)?",), fused_splits={r".*head": ("a", "b")})
    params = {p.name: p for p in build_registry(MoE(), config, ident(dp=1, tp=1, ep=1)).params}
    assert GRAD_GROUPS[params["embed.weight"].group] == "embedding"
    assert GRAD_GROUPS[params["experts.0.weight"].group] == "expert"
    assert GRAD_GROUPS[params["head.weight"].group] == "other"
    assert params["head.weight"].parts == ("a", "b") and params["head.bias"].parts == ("a", "b")
    # dp=1: a DDP replica owns nothing; each element is reported by exactly one rank
    assert not any(p.owned for p in params.values())
    params = {p.name: p for p in build_registry(MoE(), config, ident(dp=0, tp=1, ep=1)).params}
    assert params["experts.0.weight"].owned  # sharded over ep: every ep rank counts
    assert not params["head.weight"].owned  # dense, replicated over ep: ep=0 only
    assert not params["norm.weight"].owned  # replicated over tp: tp=0 only
    owner = {p.name: p for p in build_registry(MoE(), config, ident(dp=0, tp=0, ep=0)).params}
    assert all(p.owned for p in owner.values())


def test_sharded_data_parallel_parameters_are_reported_by_every_rank():
    params = build_registry(MoE(), ProbeConfig(dp_replicated=False), ident(dp=3)).params
    assert all(p.owned for p in params)
    assert not build_registry(MoE(), ProbeConfig(dp_replicated=False), ident(dp=3)).whole_gradient
