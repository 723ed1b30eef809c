"""ProbeConfig: defaults follow the seeds' cadence rule; every rejection names its field."""

from __future__ import annotations

import pytest

from probewire.instrument.catalog import Priority
from probewire.instrument.config import ProbeConfig


def test_defaults_run_p0_every_step_p1_every_100_and_p2_never():
    config = ProbeConfig()
    assert [config.every(p) for p in Priority] == [1, 100, 0]


def test_cadence_accepts_string_keys_and_keeps_the_other_defaults():
    config = ProbeConfig(cadence={"P1": 10})
    assert (config.every("P0"), config.every(Priority.P1), config.every("P2")) == (1, 10, 0)


@pytest.mark.parametrize("kwargs,field", [
    (dict(cadence={"P3": 1}), "cadence"),
    (dict(cadence={"P1": -1}), r"cadence\[P1\]"),
    (dict(cadence={"P1": 1.5}), r"cadence\[P1\]"),
    (dict(clip_threshold=0.0), "clip_threshold"),
    (dict(ring_steps=-1), "ring_steps"),
    (dict(queue_size=0), "queue_size"),
    (dict(scan_chunk_elems=0), "scan_chunk_elems"),
    (dict(module_names=r".*attn"), "module_names"),
    (dict(expert_params=("(",)), "expert_params"),
    (dict(logits_module="["), "logits_module"),
    (dict(fused_splits={r".*\.qkv": ("q",)}), "fused_splits"),
    (dict(sources=("web",), modalities=("web",)), "sources/modalities"),
    (dict(encoder="json"), "encoder"),
])
def test_a_bad_value_is_rejected_with_its_field_name(kwargs, field):
    with pytest.raises(ValueError, match=f"ProbeConfig.{field}"):
        ProbeConfig(**kwargs)


def test_config_is_immutable():
    config = ProbeConfig()
    with pytest.raises(AttributeError):
        config.queue_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.cadence[Priority.P0] = 5  # type: ignore[index]
