"""--log-format json: every record one JSON object on one line, for every service."""

from __future__ import annotations

import json
import logging
import logging.config

import pytest

from probewire.deploy.cli import main
from probewire.deploy.logs import logging_config


@pytest.fixture(autouse=True)
def _restore_root():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_records_are_one_object_per_line_with_the_traceback(capsys) -> None:
    logging.config.dictConfig(logging_config("json", "info", "worker"))
    log = logging.getLogger("probewire.test")
    log.warning("store write of %d step(s) failed\nsecond line", 3)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("flush failed")
    log.debug("not shown")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    first, second = map(json.loads, lines)
    assert first["message"] == "store write of 3 step(s) failed\nsecond line"
    assert (first["level"], first["logger"], first["service"]) == (
        "WARNING",
        "probewire.test",
        "worker",
    )
    assert first["ts"].endswith("+00:00")
    assert second["level"] == "ERROR" and "RuntimeError: boom" in second["exc_info"]


def test_the_cli_applies_the_format_to_its_command_and_refuses_others(tmp_path, capsys) -> None:
    assert (
        main(
            [
                "--log-format",
                "json",
                "health",
                "--component",
                "worker",
                "--heartbeat",
                str(tmp_path / "none"),
            ]
        )
        == 1
    )
    logging.getLogger("probewire.x").warning("hello")
    [line] = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("{")]
    assert json.loads(line)["service"] == "health"
    with pytest.raises(ValueError, match="one of text, json"):
        logging_config("xml", "info", "worker")
    with pytest.raises(SystemExit):
        main(["--log-format", "xml", "health", "--component", "worker"])
