"""Tests for probewire.evaluators.runner: checkpoints, weight streams, reference, records."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch

from probewire.deploy.demo.model import TinyConfig, TinyLM, load_checkpoint, save_checkpoint
from probewire.evaluators import (
    ByteTokenizer,
    CheckpointEvent,
    CheckpointLoader,
    EvaluationError,
    HeldoutSuite,
    evaluate_checkpoint,
)
from probewire.evaluators.datasets import HeldoutDoc
from probewire.evaluators.runner import EvaluationCancelled

FACTORY = "probewire.deploy.demo.model:load_checkpoint"
SMALL = TinyConfig(seq_len=16, d_model=16, n_layer=1, n_head=2)
SUITE = HeldoutSuite([HeldoutDoc(text="held-out text, with ümlauts.", source="unit")])


def _models(seed: int = 0) -> tuple[TinyLM, TinyLM]:
    torch.manual_seed(seed)
    raw, ema = TinyLM(SMALL), TinyLM(SMALL)
    return raw, ema


def _event(path: Path, **kwargs: object) -> CheckpointEvent:
    return CheckpointEvent(run_id="r", step=10, tokens=640, flops=1e9, path=str(path), **kwargs)


def _loader(factory: str = FACTORY) -> CheckpointLoader:
    return CheckpointLoader(factory=factory, tokenizer=ByteTokenizer())


@pytest.fixture()
def with_ema(tmp_path: Path) -> Path:
    raw, ema = _models()
    save_checkpoint(raw, tmp_path / "ema.pt", ema=ema)
    return tmp_path / "ema.pt"


@pytest.fixture()
def raw_only(tmp_path: Path) -> Path:
    raw, _ = _models()
    save_checkpoint(raw, tmp_path / "raw.pt")
    return tmp_path / "raw.pt"


def test_ema_checkpoint_extension_is_backward_compatible(with_ema: Path, raw_only: Path) -> None:
    raw, ema = _models()
    old_style = with_ema.parent / "old.pt"  # the format before the "ema" key existed
    torch.save(
        {
            "config": {"vocab": 257, "seq_len": 16, "d_model": 16, "n_layer": 1, "n_head": 2},
            "model": raw.state_dict(),
        },
        old_style,
    )
    for path in (raw_only, old_style):
        assert torch.equal(load_checkpoint(path).head.weight, raw.head.weight)
        assert load_checkpoint(path, ema=True) is None
    assert torch.equal(load_checkpoint(with_ema).head.weight, raw.head.weight)
    assert torch.equal(load_checkpoint(with_ema, ema=True).head.weight, ema.head.weight)


def test_both_streams_scored_and_ema_is_the_default_reference(with_ema: Path) -> None:
    records, failures = evaluate_checkpoint(_event(with_ema), _loader(), [SUITE])
    assert failures == []
    assert sorted((r.weights_stream, r.metric, r.reference) for r in records) == [
        ("ema", "bpb", 1),
        ("ema", "nll", 1),
        ("ema", "ppl", 1),
        ("raw", "bpb", 0),
        ("raw", "nll", 0),
        ("raw", "ppl", 0),
    ]
    values = {(r.weights_stream, r.metric): r.value for r in records}
    assert values[("raw", "bpb")] != values[("ema", "bpb")]  # different weights really loaded
    r = records[0]
    assert (r.run_id, r.step, r.tokens, r.flops, r.suite, r.n_items) == (
        "r",
        10,
        640,
        1e9,
        "heldout",
        1,
    )
    assert r.tokenizer_version == "utf8-bytes/v1" and r.dataset_version.startswith("sha256:")
    assert r.decoding_version == "loglik;bos-window/v1;context=16"  # read from cfg.seq_len


def test_raw_only_checkpoint_marks_raw_under_auto(raw_only: Path) -> None:
    records, _ = evaluate_checkpoint(_event(raw_only), _loader(), [SUITE])
    assert {(r.weights_stream, r.reference) for r in records} == {("raw", 1)}


@pytest.mark.parametrize(
    ("mode", "path_fixture", "expected"),
    [
        ("raw", "with_ema", {("raw", 1), ("ema", 0)}),
        ("ema", "with_ema", {("raw", 0), ("ema", 1)}),
        ("ema", "raw_only", {("raw", 0)}),  # pinned to EMA: a checkpoint without it has none
    ],
)
def test_pinned_reference_stream(
    mode: str, path_fixture: str, expected: set, request: pytest.FixtureRequest
) -> None:
    path = request.getfixturevalue(path_fixture)
    records, _ = evaluate_checkpoint(_event(path), _loader(), [SUITE], reference_stream=mode)
    assert {(r.weights_stream, r.reference) for r in records} == expected


def test_event_announcing_ema_weights_labels_them_ema(raw_only: Path) -> None:
    records, _ = evaluate_checkpoint(_event(raw_only, weights_stream="ema"), _loader(), [SUITE])
    assert {(r.weights_stream, r.reference) for r in records} == {("ema", 1)}


def test_factory_without_ema_keyword_scores_one_stream(
    with_ema: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    factories = types.ModuleType("pw_test_factories")
    factories.load = lambda path: load_checkpoint(path)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pw_test_factories", factories)
    loader = _loader("pw_test_factories:load")
    assert not loader.supports_ema
    records, _ = evaluate_checkpoint(_event(with_ema), loader, [SUITE])
    assert {r.weights_stream for r in records} == {"raw"}


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(EvaluationError, match=r"^checkpoint not found: .*nope\.pt$"):
        evaluate_checkpoint(_event(tmp_path / "nope.pt"), _loader(), [SUITE])


@pytest.mark.parametrize("damage", ["zeros", "truncated", "empty"])
def test_corrupt_checkpoint_is_one_line(damage: str, raw_only: Path) -> None:
    """The cause is torch's exception type and first sentence (wording varies by version)."""
    data = raw_only.read_bytes()
    path = raw_only.with_name(f"{damage}.pt")
    path.write_bytes(
        {"zeros": b"\0" * 64, "truncated": data[: len(data) // 2], "empty": b""}[damage]
    )
    with pytest.raises(EvaluationError) as info:
        evaluate_checkpoint(_event(path), _loader(), [SUITE])
    prefix = f"cannot load checkpoint {path} (raw weights) with {FACTORY}: "
    message = str(info.value)
    assert message.startswith(prefix) and "\n" not in message
    assert re.fullmatch(
        r"(UnpicklingError|RuntimeError|OSError|EOFError)(: [^\n]{1,200})?", message[len(prefix) :]
    )


def test_a_failing_suite_is_reported_and_the_others_still_score(raw_only: Path) -> None:
    class Broken:
        name = "broken"
        higher_is_better = True

        def versions(self, model: object) -> object:
            raise RuntimeError("suite exploded\nwith detail")

        def run(self, model: object, progress: object = None) -> list:
            return []

    records, failures = evaluate_checkpoint(_event(raw_only), _loader(), [Broken(), SUITE])
    assert {r.suite for r in records} == {"heldout"}
    assert [(f.suite, f.weights_stream, f.reason) for f in failures] == [
        ("broken", "raw", "RuntimeError: suite exploded")
    ]


def test_cancellation_propagates(raw_only: Path) -> None:
    def tick() -> None:
        raise EvaluationCancelled("stopping")

    with pytest.raises(EvaluationCancelled):
        evaluate_checkpoint(_event(raw_only), _loader(), [SUITE], tick=tick)
