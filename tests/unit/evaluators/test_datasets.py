"""Tests for probewire.evaluators.datasets: formats, loader errors, generators."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from probewire.evaluators.datasets import (
    ChoiceItem,
    DatasetError,
    GenerationItem,
    GroundingItem,
    HeldoutDoc,
    load_choice_set,
    load_generation_set,
    load_grounding_set,
    load_heldout_text,
    make_choice_set,
    make_generation_set,
    make_heldout_text,
    write_jsonl,
)


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# --- round trips -------------------------------------------------------------------


def test_round_trip_every_format(tmp_path: Path) -> None:
    heldout = [HeldoutDoc(text="café 中文 😀", source="unit")]
    choice = [ChoiceItem(question="2+2 is", options=("4", "5"), answer=0)]
    generation = [GenerationItem(prompt="1+1=", answer="2")]
    grounding = [GroundingItem(image_seed=3, prompt="the red square", box=(1.0, 2.0, 5.0, 6.5))]
    cases = [
        (heldout, load_heldout_text),
        (choice, load_choice_set),
        (generation, load_generation_set),
        (grounding, load_grounding_set),
    ]
    for i, (rows, load) in enumerate(cases):
        path = tmp_path / f"set{i}.jsonl"
        assert write_jsonl(path, rows) == 1
        assert load(path) == rows


def test_written_file_is_utf8_jsonl_with_documented_keys(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "c.jsonl"
    write_jsonl(path, [ChoiceItem(question="q é", options=("a", "b", "c"), answer=2)])
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and "é".encode() in raw
    assert json.loads(raw) == {"question": "q é", "options": ["a", "b", "c"], "answer": 2}
    assert not (tmp_path / "sub" / "c.jsonl.tmp").exists()


def test_write_refuses_empty_set(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        write_jsonl(tmp_path / "e.jsonl", [])


def test_loader_skips_blank_lines_and_ignores_extra_keys(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "g.jsonl",
        [
            '{"prompt": "1+2=", "answer": "3", "note": "x"}',
            "",
            "   ",
            '{"prompt": "p", "answer": "a"}',
        ],
    )
    assert load_generation_set(path) == [
        GenerationItem(prompt="1+2=", answer="3"),
        GenerationItem(prompt="p", answer="a"),
    ]


# --- errors name file and line -------------------------------------------------------

_LOADERS: dict[str, Callable[[Path], list]] = {
    "heldout": load_heldout_text,
    "choice": load_choice_set,
    "generation": load_generation_set,
    "grounding": load_grounding_set,
}


def test_malformed_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = _write_lines(
        tmp_path / "h.jsonl", ['{"text": "ok", "source": "s"}', "", '{"text": "broken", ', "{}"]
    )
    with pytest.raises(DatasetError) as info:
        load_heldout_text(path)
    assert info.value.line == 3
    assert info.value.path == str(path)
    assert str(info.value).startswith(f"{path}:3: malformed JSON")


@pytest.mark.parametrize("kind", sorted(_LOADERS))
@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_raises(tmp_path: Path, kind: str, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(DatasetError, match="empty data set") as info:
        _LOADERS[kind](path)
    assert info.value.line is None


def test_missing_file_raises_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="cannot open") as info:
        load_choice_set(tmp_path / "nope.jsonl")
    assert info.value.line is None


def test_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "b"}\n{"prompt": "\xff", "answer": "b"}\n')
    with pytest.raises(DatasetError, match="UTF-8") as info:
        load_generation_set(path)
    assert info.value.line == 2


@pytest.mark.parametrize(
    "kind, record, message",
    [
        ("heldout", {"source": "s"}, "missing field 'text'"),
        ("heldout", {"text": "", "source": "s"}, "field 'text' is empty"),
        ("heldout", {"text": 3, "source": "s"}, "field 'text' must be a string"),
        ("choice", {"question": "q", "answer": 0}, "missing field 'options'"),
        ("choice", {"question": "q", "options": ["a"], "answer": 0}, "at least 2"),
        ("choice", {"question": "q", "options": ["a", "a"], "answer": 0}, "distinct"),
        ("choice", {"question": "q", "options": ["a", ""], "answer": 0}, "non-empty"),
        ("choice", {"question": "q", "options": ["a", "b"], "answer": 2}, "not an index"),
        ("choice", {"question": "q", "options": ["a", "b"], "answer": True}, "integer"),
        ("choice", {"question": "q", "options": ["a", "b"]}, "missing field 'answer'"),
        ("generation", {"prompt": "p"}, "missing field 'answer'"),
        ("grounding", {"prompt": "p", "box": [0, 0, 1, 1]}, "missing field 'image_seed'"),
        ("grounding", {"image_seed": -1, "prompt": "p", "box": [0, 0, 1, 1]}, ">= 0"),
        ("grounding", {"image_seed": 1, "prompt": "p", "box": [0, 0, 1]}, "field 'box'"),
        ("grounding", {"image_seed": 1, "prompt": "p", "box": [2, 0, 1, 1]}, "x1 >= x0"),
        ("grounding", {"image_seed": 1, "prompt": "p", "box": [0, 0, "1", 1]}, "numbers"),
        ("generation", ["p", "a"], "expected a JSON object"),
    ],
)
def test_bad_record_names_line_and_problem(
    tmp_path: Path, kind: str, record: object, message: str
) -> None:
    good = {
        "heldout": {"text": "t", "source": "s"},
        "choice": {"question": "q", "options": ["a", "b"], "answer": 1},
        "generation": {"prompt": "p", "answer": "a"},
        "grounding": {"image_seed": 0, "prompt": "p", "box": [0, 0, 1, 1]},
    }[kind]
    path = _write_lines(tmp_path / f"{kind}.jsonl", [json.dumps(good), json.dumps(record)])
    with pytest.raises(DatasetError, match=re.escape(message)) as info:
        _LOADERS[kind](path)
    assert info.value.line == 2
    assert str(info.value).startswith(f"{path}:2: ")


# --- generators ----------------------------------------------------------------------


def test_heldout_generator_is_deterministic_and_non_empty() -> None:
    docs = make_heldout_text(8, seed=1)
    assert docs == make_heldout_text(8, seed=1)
    assert docs != make_heldout_text(8, seed=2)
    assert len(docs) == 8 and len({d.text for d in docs}) == 8
    assert all(len(d.text) >= 200 and len(d.text.encode()) >= 200 for d in docs)
    assert all(re.fullmatch(r"python3\.\d+-stdlib:[\w.]+", d.source) for d in docs)


def test_choice_generator_builds_answerable_questions() -> None:
    items = make_choice_set(20, seed=4)
    assert items == make_choice_set(20, seed=4)
    assert items != make_choice_set(20, seed=5)
    assert len(items) == 20
    for item in items:
        assert len(item.options) == 4 and len(set(item.options)) == 4
        assert item.question and all(item.options)
        assert (item.question + " " + item.options[item.answer]).endswith(".")
    assert len({item.answer for item in items}) > 1  # the right option is not always first


def test_generation_generator_answers_are_exact() -> None:
    items = make_generation_set(50, seed=9)
    assert items == make_generation_set(50, seed=9)
    kinds = set()
    for item in items:
        if m := re.fullmatch(r"(\d+)\+(\d+)=", item.prompt):
            assert item.answer == str(int(m[1]) + int(m[2]))
            kinds.add("sum")
        else:
            m = re.fullmatch(r"Repeat the word: ([a-z]+)\nAnswer:", item.prompt)
            assert m is not None and item.answer == m[1]
            kinds.add("repeat")
    assert kinds == {"sum", "repeat"}


def test_generated_sets_survive_write_and_load(tmp_path: Path) -> None:
    choice = make_choice_set(5, seed=0)
    write_jsonl(tmp_path / "c.jsonl", choice)
    assert load_choice_set(tmp_path / "c.jsonl") == choice
    heldout = make_heldout_text(3, seed=0)
    write_jsonl(tmp_path / "h.jsonl", heldout)
    assert load_heldout_text(tmp_path / "h.jsonl") == heldout


@pytest.mark.parametrize(
    "call",
    [
        lambda: make_heldout_text(0, 1),
        lambda: make_choice_set(10**6, 1),
        lambda: make_choice_set(3, 1, 1),
        lambda: make_generation_set(0, 1),
    ],
)
def test_generators_reject_bad_sizes(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        call()
