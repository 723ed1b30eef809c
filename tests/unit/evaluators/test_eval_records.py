"""Tests for probewire.evaluators.records: the checkpoint and eval wire formats."""

from __future__ import annotations

import json

import pytest

from probewire.evaluators import CheckpointEvent, EvalRecord, EvaluationError

GOOD = {
    "run_id": "r1",
    "step": 100,
    "tokens": 6400,
    "flops": 1.5e12,
    "path": "/ck/100.pt",
    "weights_stream": "raw",
    "key": False,
    "planned_tokens": 640000,
}

EVAL_FIELDS = [
    "run_id",
    "step",
    "tokens",
    "flops",
    "suite",
    "metric",
    "value",
    "n_items",
    "weights_stream",
    "reference",
    "suite_version",
    "dataset_version",
    "tokenizer_version",
    "prompt_version",
    "decoding_version",
    "postprocess_version",
    "judge_version",
    "time_unix_nano",
]


def test_checkpoint_event_round_trip() -> None:
    event = CheckpointEvent.from_json(json.dumps(GOOD))
    assert event == CheckpointEvent(
        run_id="r1", step=100, tokens=6400, flops=1.5e12, path="/ck/100.pt", planned_tokens=640000
    )
    assert CheckpointEvent.from_json(event.to_json()) == event


def test_optional_fields_default() -> None:
    minimal = {k: GOOD[k] for k in ("run_id", "step", "tokens", "flops", "path")}
    event = CheckpointEvent.from_json(json.dumps(minimal))
    assert (event.weights_stream, event.key, event.planned_tokens) == ("raw", False, None)
    assert "planned_tokens" not in json.loads(event.to_json())


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"run_id": ""}, "'run_id' must be a non-empty string"),
        ({"step": -1}, "'step' must be an integer >= 0"),
        ({"tokens": 1.5}, "'tokens' must be an integer >= 0"),
        ({"tokens": True}, "'tokens' must be an integer >= 0"),
        ({"flops": "many"}, "'flops' must be a number >= 0"),
        ({"path": None}, "'path' must be a non-empty string"),
        ({"weights_stream": "swa"}, "'weights_stream' must be one of"),
        ({"key": "yes"}, "'key' must be a boolean"),
        ({"planned_tokens": 0}, "'planned_tokens' must be an integer >= 1"),
    ],
)
def test_malformed_events_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(EvaluationError, match=message):
        CheckpointEvent.from_json(json.dumps({**GOOD, **change}))


@pytest.mark.parametrize("payload", [b"\xff\xfe", b"not json", b"[1, 2]"])
def test_non_object_payloads_are_rejected(payload: bytes) -> None:
    with pytest.raises(EvaluationError, match="checkpoint event: "):
        CheckpointEvent.from_json(payload)


def test_eval_record_json_has_the_documented_fields() -> None:
    record = EvalRecord(
        run_id="r",
        step=1,
        tokens=2,
        flops=3.0,
        suite="heldout",
        metric="bpb",
        value=None,
        n_items=4,
        weights_stream="ema",
        reference=1,
        suite_version="s",
        dataset_version="d",
        tokenizer_version="t",
        prompt_version="p",
        decoding_version="dc",
        postprocess_version="none",
        judge_version="none",
        time_unix_nano=5,
    )
    body = json.loads(record.to_json())
    assert list(body) == EVAL_FIELDS
    assert body["value"] is None
    assert EvalRecord.from_json(record.to_json()) == record


def test_evaluation_error_is_one_line() -> None:
    assert str(EvaluationError("cannot load\n  checkpoint   x")) == "cannot load checkpoint x"
