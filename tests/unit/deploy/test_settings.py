"""The settings tree: precedence, coercion and errors that name the field."""

from __future__ import annotations

import pytest

from probewire.deploy.settings import SettingsError, load_settings


def test_env_overrides_file_and_values_are_coerced(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("stream:\n  deadline_s: 12\n  detector_window: 50\nevaluator:\n  enabled: true\n")
    s = load_settings(config, env={"PROBEWIRE_STREAM__DEADLINE_S": "7.5",
                                   "PROBEWIRE_EVALUATOR__ENABLED": "false"})
    assert s.stream.deadline_s == 7.5 and s.stream.detector_window == 50
    assert s.evaluator.enabled is False


@pytest.mark.parametrize("env, field", [
    ({"PROBEWIRE_STREAM__DEADLINE_S": "-1"}, "stream.deadline_s"),
    ({"PROBEWIRE_STREAM__DETECTOR_WINDOW": "ten"}, "stream.detector_window"),
    ({"PROBEWIRE_CLICKHOUSE__URL": "mysql://x"}, "clickhouse.url"),
    ({"PROBEWIRE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL"}, "kafka.sasl_mechanism"),
    ({"PROBEWIRE_EVALUATOR__EVERY_FRACTION": "0.1"}, "evaluator.every_fraction"),
    ({"PROBEWIRE_STREAM__NOPE": "1"}, "stream.nope"),
    ({"PROBEWIRE_STREAM__STRAGGLER_RATIO": "1.0"}, "stream.straggler_ratio"),
    ({"PROBEWIRE_STREAM__STRAGGLER_STEPS": "0"}, "stream.straggler_steps"),
])
def test_bad_values_name_the_field(env, field):
    with pytest.raises(SettingsError, match=field.replace(".", r"\.")):
        load_settings(env=env)


def test_missing_config_file_is_a_settings_error(tmp_path):
    with pytest.raises(SettingsError, match="file not found"):
        load_settings(tmp_path / "absent.yaml", env={})


def test_sasl_password_comes_from_env_not_from_settings():
    s = load_settings(env={"PROBEWIRE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                           "PROBEWIRE_KAFKA__SASL_MECHANISM": "PLAIN"})
    assert "sasl_password" not in s.to_dict()["kafka"]
