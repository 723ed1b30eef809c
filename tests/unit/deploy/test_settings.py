"""The settings tree: precedence, coercion and errors that name the field."""

from __future__ import annotations

import pytest

from probewire.deploy.settings import SettingsError, load_settings


def test_env_overrides_file_and_values_are_coerced(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "stream:\n  deadline_s: 12\n  stage2:\n    detectors:\n      window: 50\n"
        "evaluator:\n  enabled: true\n"
    )
    s = load_settings(
        config,
        env={
            "PROBEWIRE_STREAM__DEADLINE_S": "7.5",
            "PROBEWIRE_EVALUATOR__ENABLED": "false",
            "PROBEWIRE_STREAM__STAGE2__RUN_IDLE_S": "300",
        },
    )
    assert s.stream.deadline_s == 7.5 and s.stream.stage2.detectors.window == 50
    assert s.stream.stage2.run_idle_s == 300.0 and s.stream.stage2.retention_every_k == 100
    assert s.evaluator.enabled is False


def test_each_default_is_written_once_in_its_component():
    """The settings tree is built from the components' own configs: their defaults are the
    tree's defaults (no second copy in deploy)."""
    from probewire.stream.config import StreamConfig
    from probewire.stream.signals import DetectorConfig

    s = load_settings(env={})
    assert s.stream == StreamConfig() and s.stream.stage2.detectors == DetectorConfig()


@pytest.mark.parametrize(
    "env, field",
    [
        ({"PROBEWIRE_STREAM__DEADLINE_S": "-1"}, "stream.deadline_s"),
        ({"PROBEWIRE_STREAM__STAGE2__DETECTORS__WINDOW": "ten"}, "stream.stage2.detectors.window"),
        ({"PROBEWIRE_STREAM__STAGE2__DETECTORS__WINDOW": "2"}, "stream.stage2.detectors.window"),
        ({"PROBEWIRE_STREAM__STAGE2__MAX_WAIT_S": "5"}, "stream.stage2.max_wait_s"),
        ({"PROBEWIRE_STREAM__BATCH__STEPS": "0"}, "stream.batch.steps"),
        ({"PROBEWIRE_STREAM__BOUNDS__MAX_WORLD_SIZE": "0"}, "stream.bounds.max_world_size"),
        ({"PROBEWIRE_STREAM__MAX_MESSAGE_BYTES": "10"}, "stream.max_message_bytes"),
        ({"PROBEWIRE_CLICKHOUSE__DATABASE": "a-b"}, "clickhouse.database"),
        ({"PROBEWIRE_CLICKHOUSE__URL": "mysql://x"}, "clickhouse.url"),
        ({"PROBEWIRE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL"}, "kafka.sasl_mechanism"),
        ({"PROBEWIRE_EVALUATOR__EVERY_FRACTION": "0.1"}, "evaluator.every_fraction"),
        ({"PROBEWIRE_STREAM__NOPE": "1"}, "stream.nope"),
        ({"PROBEWIRE_STREAM__ROLE": "stage2"}, "stream.role"),
        (
            {"PROBEWIRE_STREAM__STAGE2__DETECTORS__STRAGGLER_RATIO": "1.0"},
            "stream.stage2.detectors.straggler_ratio",
        ),
        (
            {"PROBEWIRE_STREAM__STAGE2__DETECTORS__STRAGGLER_STEPS": "0"},
            "stream.stage2.detectors.straggler_steps",
        ),
    ],
)
def test_bad_values_name_the_field(env, field):
    with pytest.raises(SettingsError, match=field.replace(".", r"\.")):
        load_settings(env=env)


def test_worker_role_from_env_and_from_overrides():
    assert load_settings(env={}).stream.role == "all"
    assert load_settings(env={"PROBEWIRE_STREAM__ROLE": "stage1"}).stream.role == "stage1"
    assert load_settings(env={}, overrides={"stream": {"role": "stage1"}}).stream.role == "stage1"


def test_missing_config_file_is_a_settings_error(tmp_path):
    with pytest.raises(SettingsError, match="file not found"):
        load_settings(tmp_path / "absent.yaml", env={})


def test_sasl_password_comes_from_env_not_from_settings():
    s = load_settings(
        env={
            "PROBEWIRE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
            "PROBEWIRE_KAFKA__SASL_MECHANISM": "PLAIN",
        }
    )
    assert "sasl_password" not in s.to_dict()["kafka"]
