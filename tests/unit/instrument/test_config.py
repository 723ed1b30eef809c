"""ProbeConfig: defaults follow the seeds' cadence rule; every rejection names its field."""

from __future__ import annotations

import pytest

from probewire.instrument.catalog import Tier
from probewire.instrument.config import ProbeConfig


def test_defaults_run_the_step_tier_every_step_scans_every_100_and_forensics_never():
    config = ProbeConfig()
    assert [config.every(t) for t in Tier] == [1, 100, 0]


def test_cadence_accepts_string_keys_and_keeps_the_other_defaults():
    config = ProbeConfig(cadence={"scan": 10})
    assert (config.every("step"), config.every(Tier.SCAN), config.every("demand")) == (1, 10, 0)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(cadence={"P1": 1}), "cadence"),
        (dict(cadence={"scan": -1}), r"cadence\[scan\]"),
        (dict(cadence={"scan": 1.5}), r"cadence\[scan\]"),
        (dict(clip_threshold=0.0), "clip_threshold"),
        (dict(ring_steps=-1), "ring_steps"),
        (dict(queue_size=0), "queue_size"),
        (dict(scan_chunk_elems=0), "scan_chunk_elems"),
        (dict(module_names=r".*attn"), "module_names"),
        (dict(expert_params=("(",)), "expert_params"),
        (dict(logits_module="["), "logits_module"),
        (dict(fused_splits={r".*\.qkv": ("q",)}), "fused_splits"),
        (dict(sources=("web",), modalities=("web",)), "sources/modalities"),
    ],
)
def test_a_bad_value_is_rejected_with_its_field_name(kwargs, field):
    with pytest.raises(ValueError, match=f"ProbeConfig.{field}"):
        ProbeConfig(**kwargs)


def test_config_is_immutable():
    config = ProbeConfig()
    with pytest.raises(AttributeError):
        config.queue_size = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.cadence[Tier.STEP] = 5  # type: ignore[index]
