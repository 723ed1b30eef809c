"""Tensor labels -> bounded dimensions (block, role, expert) for ``tensor_names``: the role
set of a real model is one block's worth, whatever its depth and expert count."""

from __future__ import annotations

import pytest

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.instrument.registry import label_name
from probewire.stream.dimensions import tensor_dimensions
from probewire.stream.localize import layer_of_tensor


@pytest.mark.parametrize(
    "name, expected",
    [
        ("blocks.3.moe.experts.5.w1.weight", (3, "moe.experts.w1.weight", 5)),
        ("blocks.0", (0, "block", None)),
        ("model.layers.12.self_attn.q_proj.weight", (12, "self_attn.q_proj.weight", None)),
        ("blocks.1.attn.qkv.q", (1, "attn.qkv.q", None)),
        ("blocks.1.mlp.experts.gate_up_proj", (1, "mlp.experts.gate_up_proj", None)),
        ("layers.2.expert.7", (2, "expert", 7)),
        ("embed.weight", (None, "embed.weight", None)),
        ("head", (None, "head", None)),
        ("experts.4.w2", (None, "experts.w2", 4)),
    ],
)
def test_tensor_dimensions(name, expected):
    assert tensor_dimensions(name) == expected


def test_a_real_models_roles_are_one_blocks_worth():
    cfg = TinyConfig.preset("moe", n_layer=3)
    model = TinyLM(cfg)
    names = [label_name(n) for n, _ in model.named_parameters()]
    names += [label_name(n) for n, _ in model.named_modules() if n]
    dims = [tensor_dimensions(n) for n in names]
    by_layer: dict[int, set[str]] = {}
    experts: set[int] = set()
    for name, (layer, role, expert) in zip(names, dims):
        assert layer == (None if layer is None else int(layer_of_tensor(name)[0]))
        if layer is not None:
            by_layer.setdefault(layer, set()).add(role)
        if expert is not None:
            experts.add(expert)
    assert sorted(by_layer) == [0, 1, 2]
    assert by_layer[0] == by_layer[1] == by_layer[2]  # roles do not grow with depth
    assert experts == set(range(cfg.n_experts))
    roles = {role for _, role, _ in dims}
    assert len(roles) < len(names) / 2
    assert not any(
        str(e) in role.split(".")
        for role in roles
        for e in range(cfg.n_experts)
        if "experts" in role
    )
