"""Tests for probewire.evaluators.cli: registration and one-line start-up errors."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from probewire.deploy.cli import main
from probewire.evaluators import add_evaluator_parser
from probewire.evaluators.cli import cmd_evaluator
from probewire.evaluators.config import EvaluatorSetup


def test_parser_registers_the_evaluator_command() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_evaluator_parser(parser.add_subparsers(dest="command"), lambda path: EvaluatorSetup())
    args = parser.parse_args(
        [
            "evaluator",
            "--once",
            "--data-dir",
            "d",
            "--suites",
            "heldout,choice",
            "--reference-stream",
            "raw",
        ]
    )
    assert (args.func, args.once, args.data_dir, args.suites, args.reference_stream) == (
        cmd_evaluator,
        True,
        "d",
        "heldout,choice",
        "raw",
    )


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (
            {"PROBEWIRE_EVALUATOR__MODEL_FACTORY": "probewire.nowhere:load"},
            [],
            "probewire: error: model factory 'probewire.nowhere:load': module 'probewire.nowhere' "
            "does not import",
        ),
        (
            {"PROBEWIRE_EVALUATOR__MODEL_FACTORY": "probewire.deploy.demo.model:BOS"},
            [],
            "probewire: error: model factory 'probewire.deploy.demo.model:BOS': 'BOS' is not callable",
        ),
        (
            {"PROBEWIRE_EVALUATOR__MODEL_FACTORY": "no-colon"},
            [],
            "probewire: error: evaluator.model_factory: must look like 'module:function'",
        ),
        ({}, ["--suites", "heldout,bleu"], "probewire: error: unknown suite(s) ['bleu']"),
        # the evaluator.* settings are the defaults of the flags (a Helm deployment has no flags)
        (
            {"PROBEWIRE_EVALUATOR__SUITES": "heldout,bleu"},
            [],
            "probewire: error: unknown suite(s) ['bleu']",
        ),
        (
            {"PROBEWIRE_EVALUATOR__REFERENCE_STREAM": "best"},
            [],
            "probewire: error: evaluator.reference_stream: must be auto, raw or ema, got 'best'",
        ),
        (
            {"PROBEWIRE_EVALUATOR__TOKENIZER": "probewire.nowhere:Tok"},
            ["--suites", "heldout"],
            "probewire: error: tokenizer 'probewire.nowhere:Tok'",
        ),
    ],
)
def test_start_up_mistakes_exit_2_with_one_line(
    env: dict[str, str],
    args: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = main(["evaluator", "--data-dir", str(tmp_path), *args])
    # the evaluator's own INFO records (its log level defaults to info) are not the error
    err = "".join(
        line
        for line in capsys.readouterr().err.splitlines(keepends=True)
        if " INFO probewire." not in line
    )
    assert code == 2
    assert err.startswith(message) and err.count("\n") == 1


def test_empty_dataset_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "heldout.jsonl").write_text("")
    # data sets are read after the broker check, and the unit tier has no broker (that
    # order, broker first, is tests/integration/test_cli_errors.py's)
    monkeypatch.setattr("probewire.deploy.cli._preflight", lambda settings, heartbeat: None)
    monkeypatch.setenv("PROBEWIRE_EVALUATOR__SUITES", "heldout,bleu")  # the flag wins
    assert main(["evaluator", "--data-dir", str(tmp_path), "--suites", "heldout"]) == 2
    err = "".join(
        line
        for line in capsys.readouterr().err.splitlines(keepends=True)
        if " INFO probewire." not in line
    )  # the evaluator's own INFO records
    assert err == (
        f"probewire: error: heldout data: "
        f"{tmp_path / 'heldout.jsonl'}: empty data set: "
        "no records\n"
    )


def test_disabled_evaluator_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PROBEWIRE_EVALUATOR__ENABLED", "false")
    assert main(["evaluator"]) == 0
    assert "disabled" in capsys.readouterr().err
