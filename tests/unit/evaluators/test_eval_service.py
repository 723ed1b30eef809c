"""Tests for probewire.evaluators.service without a broker: ``process`` and start-up checks."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from probewire.deploy.demo.model import TinyConfig, TinyLM, save_checkpoint
from probewire.deploy.health import read_heartbeat
from probewire.deploy.settings import EvaluatorSettings, Settings
from probewire.evaluators import EvaluationError, EvaluatorOptions, EvaluatorService
from probewire.evaluators.runner import EvaluationCancelled


@pytest.fixture()
def service(tmp_path: Path) -> EvaluatorService:
    options = EvaluatorOptions(
        suites=("heldout",),
        data_dir=str(tmp_path / "data"),
        heartbeat_path=tmp_path / "evaluator.heartbeat",
    )
    return EvaluatorService(Settings().evaluator_setup(), options)


@pytest.fixture()
def checkpoint(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    cfg = TinyConfig(seq_len=16, d_model=16, n_layer=1, n_head=2)
    save_checkpoint(TinyLM(cfg), tmp_path / "ck.pt", ema=TinyLM(cfg))
    return tmp_path / "ck.pt"


def _payload(path: Path, tokens: int, **extra: object) -> bytes:
    return json.dumps(
        {
            "run_id": "run-a",
            "step": tokens // 10,
            "tokens": tokens,
            "flops": 1e9,
            "path": str(path),
            "planned_tokens": 1000,
            **extra,
        }
    ).encode()


def test_malformed_announcement_goes_to_dead_letter(service: EvaluatorService) -> None:
    source = {"topic": "probewire.checkpoints", "partition": 2, "offset": 17}
    result = service.process(b'{"run_id": "run-a"}', source)
    assert not result.evaluated and result.records == []
    [body] = result.deadletters
    assert body["source"] == "evaluator" and body["reason"].startswith("checkpoint event: ")
    assert (body["topic"], body["partition"], body["offset"]) == ("probewire.checkpoints", 2, 17)
    assert base64.b64decode(body["payload_b64"]) == b'{"run_id": "run-a"}'


def test_crossing_checkpoint_is_scored_on_both_streams(
    service: EvaluatorService, checkpoint: Path
) -> None:
    result = service.process(_payload(checkpoint, 10))
    assert result.evaluated and result.reason == "crossed 1% of plan" and result.deadletters == []
    assert sorted((r.weights_stream, r.metric) for r in result.records) == [
        ("ema", "bpb"),
        ("ema", "nll"),
        ("ema", "ppl"),
        ("raw", "bpb"),
        ("raw", "nll"),
        ("raw", "ppl"),
    ]
    again = service.process(_payload(checkpoint, 10))
    assert not again.evaluated and again.reason == "already evaluated at 10 tokens"
    assert not service.process(_payload(checkpoint, 15)).evaluated  # no new 1% mark


def test_failed_checkpoint_is_dead_lettered_and_the_next_one_scores(
    service: EvaluatorService, checkpoint: Path, tmp_path: Path
) -> None:
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x00" * 64)
    failed = service.process(_payload(corrupt, 10, key=True))
    assert not failed.evaluated
    [body] = failed.deadletters
    assert body["reason"].startswith(f"cannot load checkpoint {corrupt} (raw weights)")
    assert (body["run_id"], body["step"], body["path"]) == ("run-a", 1, str(corrupt))
    assert service.process(_payload(checkpoint, 20)).evaluated
    beat = read_heartbeat(service.heartbeat.path)
    assert beat["component"] == "evaluator" and beat["status"] == "ready"
    assert beat["runs"]["run-a"] == {"evaluated": 1, "skipped": 0, "failed": 1, "last_step": 2}


def test_stop_request_cancels_an_evaluation_in_progress(
    service: EvaluatorService, checkpoint: Path
) -> None:
    service.stop_event.set()
    with pytest.raises(EvaluationCancelled):
        service.process(_payload(checkpoint, 10))


def test_bad_factory_fails_at_start_up(tmp_path: Path) -> None:
    settings = Settings(evaluator=EvaluatorSettings(model_factory="probewire.nowhere:load"))
    with pytest.raises(EvaluationError, match=r"module 'probewire\.nowhere' does not import"):
        EvaluatorService(
            settings.evaluator_setup(),
            EvaluatorOptions(data_dir=str(tmp_path), heartbeat_path=tmp_path / "hb"),
        )


def test_default_group_is_derived_from_the_app_id(service: EvaluatorService) -> None:
    assert service.group_id == "probewire.evaluator"


def test_suite_failures_make_one_dead_letter_and_the_rest_is_published(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A text-only model cannot ground boxes: both streams fail that suite, heldout scores."""
    options = EvaluatorOptions(
        suites=("heldout", "grounding"),
        data_dir=str(tmp_path / "data"),
        heartbeat_path=tmp_path / "hb",
    )
    service = EvaluatorService(Settings().evaluator_setup(), options)
    result = service.process(_payload(checkpoint, 10))
    assert result.evaluated
    assert {(r.suite, r.weights_stream) for r in result.records} == {
        ("heldout", "raw"),
        ("heldout", "ema"),
    }
    [body] = result.deadletters
    assert body["reason"].startswith(
        "2 suite run(s) failed: suite grounding on raw weights: "
        "EvaluationError: suite grounding needs a model with "
        "predict_box(image, prompt); suite grounding on ema"
    )
    assert [(f["suite"], f["weights_stream"]) for f in body["failures"]] == [
        ("grounding", "raw"),
        ("grounding", "ema"),
    ]
