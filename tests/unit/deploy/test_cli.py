"""User mistakes on the command line: one line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import pytest

from probewire.deploy.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sql", "--store", "/nonexistent/store", "SELECT 1"], "no store at"),
        (["demo", "--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_user_error_exits_2_with_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_bad_setting_from_env_is_a_user_error(monkeypatch, capsys):
    monkeypatch.setenv("PROBEWIRE_STREAM__DEADLINE_S", "-3")
    assert main(["demo", "--steps", "1"]) == 2
    assert "stream.deadline_s" in capsys.readouterr().err


def test_health_reports_missing_heartbeat(tmp_path, capsys):
    assert main(["health", "--component", "worker", "--heartbeat", str(tmp_path / "x")]) == 1
    assert "no heartbeat" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--run-id", "a\nb"],
        ["run", "--run-id", "a\x1b[2Jb", "--", "true"],
        ["run", "--run-id", "tab\there", "--", "true"],
    ],
    ids=["newline", "escape", "tab"],
)
def test_a_run_id_with_control_characters_is_one_line(argv, capsys):
    """A --run-id holding a control character is refused before anything starts: exit 2,
    one line naming --run-id, the character shown escaped (the terminal is not driven)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--run-id" in err and "control" in err
    assert "\x1b" not in err and "\t" not in err


def test_an_unreachable_server_url_is_reported_without_its_password(capsys):
    """`cannot reach ClickHouse at URL` names the server without the password written
    into the URL (and nothing else printed carries it)."""
    assert main(["sql", "--clickhouse-url", "http://writer:S3CRETPW@127.0.0.1:9/", "SELECT 1"]) == 2
    captured = capsys.readouterr()
    assert "cannot reach ClickHouse at http://127.0.0.1:9/" in captured.err
    assert "S3CRETPW" not in captured.err + captured.out


def test_a_worker_that_stops_by_itself_logs_why_at_error_level_and_exits_non_zero(caplog):
    """Faust returned without a signal asking it to: the reason (its crash) is logged at
    error level and the exit code is non-zero, so that an orchestrator restarts it; a
    worker stopped by SIGTERM keeps Faust's code."""
    import types

    from probewire.deploy.cli import _worker_exit

    app = types.SimpleNamespace(crash_reason=RuntimeError("topic vanished"))
    by_itself = types.SimpleNamespace(_signal_stop_time=None, crash_reason=None)
    with caplog.at_level("ERROR"):
        assert _worker_exit(by_itself, app, 0) == 1
    [record] = caplog.records
    assert record.levelname == "ERROR" and "RuntimeError: topic vanished" in record.getMessage()
    asked = types.SimpleNamespace(_signal_stop_time=12.0, crash_reason=None)
    assert _worker_exit(asked, types.SimpleNamespace(crash_reason=None), 0) == 0


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "--run", "r", "--step", "-1"], "argument --step: -1 is below 0"),
        (["explain", "--run", "r", "--step", "x"], "argument --step: 'x' is not an integer"),
        (["explain", "--run", "r", "--step", "3", "--window", "2"], "--window: 2 is below 3"),
        (["explain", "--run", "r", "--step", "3", "--z", "nan"], "--z: nan is not > 0"),
        (["health", "--component", "nope"], "argument --component: invalid choice"),
    ],
)
def test_an_out_of_range_argument_is_a_one_line_usage_error(argv, message, capsys):
    """Usage mistakes print one line (argparse printed its whole usage first), exit 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["sql", "--store", "/nonexistent/store", "SELECT 1"], "no store at"),
        (["demo", "--steps", "0"], "--steps must be >= 1"),
    ],
)
def test_with_log_format_json_a_cli_error_is_one_json_object(argv, message, capsys):
    """``--log-format json``: the error line a log collector reads is JSON, not text."""
    import json

    assert main(["--log-format", "json", *argv]) in (1, 2)
    [line] = capsys.readouterr().err.splitlines()
    body = json.loads(line)
    assert body["level"] == "ERROR" and message in body["message"], body
