"""Explosion localisation: the walk from the output inward and per-tensor robust detectors
(the demo-model scenario, one block's weights scaled, is tests/scenario/test_localize_demo.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probewire.stream.localize import (
    ExplosionLocator,
    Localisation,
    layer_of_tensor,
    layer_views,
    walk_order,
)


def locate_explosion(
    history: list[dict[str, float]], current: dict[str, float]
) -> Localisation | None:
    """The layer ``current`` names after the steps in ``history`` (oldest first), through
    the locator the stream runs."""
    locator = ExplosionLocator()
    for values in history:
        locator.update(values)
    return locator.update(current)


@pytest.mark.parametrize(
    "tensor, depth, key",
    [
        ("head", math.inf, "output"),
        ("ln_f", math.inf, "output"),
        ("mtp.0.head", math.inf, "output"),
        ("blocks.3", 3.0, "blocks.3"),
        ("blocks.3.mlp.experts.1.up", 3.0, "blocks.3"),
        ("model.layers.12.self_attn.v_proj", 12.0, "model.layers.12"),
        ("transformer.h.0.attn.c_attn.v", 0.0, "transformer.h.0"),
        ("embed", -1.0, "embeddings"),
        ("pos", -1.0, "embeddings"),
        ("model.embed_tokens", -1.0, "embeddings"),
        ("transformer.wte", -1.0, "embeddings"),
    ],
)
def test_layer_of_tensor(tensor, depth, key):
    assert layer_of_tensor(tensor) == (depth, key)


def test_walk_goes_from_the_output_inward_and_views_take_the_layer_maximum():
    assert walk_order(["blocks.0", "embeddings", "blocks.10", "output", "blocks.2"]) == [
        "output",
        "blocks.10",
        "blocks.2",
        "blocks.0",
        "embeddings",
    ]
    views = layer_views(
        {"blocks.1": 1.0, "blocks.1.mlp": 3.0, "head": 2.0, "blocks.0.attn": math.nan}
    )
    assert views["blocks.1"] == 3.0 and views["output"] == 2.0 and math.isnan(views["blocks.0"])


def history(steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    base = {
        "head": 1e-2,
        "blocks.2": 1e-3,
        "blocks.2.mlp.up": 2e-4,
        "blocks.1": 1.2e-3,
        "blocks.1.mlp.up": 3e-4,
        "blocks.0": 2e-3,
        "embed": 5e-3,
    }
    return [
        {k: v * math.exp(0.1 * rng.standard_normal()) for k, v in base.items()}
        for _ in range(steps)
    ], base


def test_the_first_jumping_layer_from_the_output_is_named():
    past, base = history(30)
    current = dict(base)
    current["blocks.2"] = base["blocks.2"] / 8  # outward of the culprit: falls
    current["blocks.1.mlp.up"] = base["blocks.1.mlp.up"] * 5  # the culprit's internal
    current["blocks.0"] = base["blocks.0"] * 4  # inward: also jumps, but later in the walk
    found = locate_explosion(past, current)
    assert found is not None and (found.layer, found.tensor) == ("blocks.1", "blocks.1.mlp.up")
    assert found.z > 6 and found.baseline == pytest.approx(base["blocks.1.mlp.up"], rel=0.2)
    assert [layer for layer, _ in found.walked] == ["output", "blocks.2", "blocks.1"]


def test_nothing_is_named_without_a_jump_and_a_nonfinite_value_is_named_at_once():
    past, base = history(30)
    assert locate_explosion(past, dict(base)) is None
    fresh = ExplosionLocator()
    assert fresh.update({**base, "blocks.2": math.inf}).layer == "blocks.2"  # during warm-up
