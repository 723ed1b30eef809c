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
