"""Tests for probewire.evaluators.datadir: demo sets and suites built from a directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from probewire.deploy.demo.data import _MODULES as DEMO_TRAINING_MODULES
from probewire.evaluators import EvaluationError, build_suites, ensure_demo_datasets
from probewire.evaluators.datadir import DATA_FILES, SUITE_NAMES
from probewire.evaluators.datasets import load_choice_set, load_heldout_text


def test_demo_sets_are_written_once_and_never_overwritten(tmp_path: Path) -> None:
    mine = tmp_path / "choice.jsonl"
    mine.write_text('{"question": "q", "options": ["a", "b"], "answer": 1}\n')
    written = ensure_demo_datasets(tmp_path)
    assert sorted(p.name for p in written) == [
        "generation.jsonl",
        "grounding.jsonl",
        "heldout.jsonl",
    ]
    assert load_choice_set(mine)[0].options == ("a", "b")  # the user's set survives
    assert ensure_demo_datasets(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(DATA_FILES.values())


def test_heldout_text_avoids_the_demo_training_modules(tmp_path: Path) -> None:
    ensure_demo_datasets(tmp_path)
    docs = load_heldout_text(tmp_path / "heldout.jsonl")
    modules = {d.source.split(":", 1)[1].split(".")[0] for d in docs}
    assert len(docs) == 24 and len(modules) > 5
    assert modules.isdisjoint(DEMO_TRAINING_MODULES)


def test_every_suite_builds_from_the_demo_sets(tmp_path: Path) -> None:
    ensure_demo_datasets(tmp_path)
    suites = build_suites(SUITE_NAMES, tmp_path)
    assert [s.name for s in suites] == list(SUITE_NAMES)


def test_unknown_suite_name(tmp_path: Path) -> None:
    with pytest.raises(EvaluationError, match=r"unknown suite\(s\) \['perplexity'\]; known: "):
        build_suites(["heldout", "perplexity"], tmp_path)


def test_empty_dataset_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "heldout.jsonl").write_text("\n\n")
    with pytest.raises(EvaluationError) as info:
        build_suites(["heldout"], tmp_path)
    assert (
        str(info.value) == f"heldout data: {tmp_path / 'heldout.jsonl'}: empty data set: no records"
    )


def test_missing_dataset_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EvaluationError, match=r"choice data: .*choice\.jsonl: cannot open"):
        build_suites(["choice"], tmp_path)
