"""The framework integrations end to end on 2 gloo ranks under `probewire run`: the
transformers Trainer callback and the Lightning callback. Stored L must equal the loss the
framework computed for the step.

- Trainer (examples/train_hf_trainer.py, logging_steps=1): its logged ``loss`` is
  Σ_ranks Σ_tokens ℓ / num_items_in_batch (average_tokens_across_devices), summed in float32
  by the model's loss (it upcasts the logits to float32); probewire sums the same float32
  token losses in float64. Equal within float32 summation: relative 1e-6. Its logged
  ``grad_norm`` (before clipping) and ``learning_rate`` equal G2 and lr to 1e-12.
- Lightning (examples/train_lightning.py, float64): ``train_loss`` logged with
  ``sync_dist=True`` is the mean over ranks of each rank's valid-token mean, which is L
  when every rank has the same valid-token count (the example's data); equal to 1e-12.
  Each rank's own float64 loss sum and count give L = Σ sums / Σ counts to 1e-12 as well.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
REL = 1e-12


def test_hf_trainer_callback_on_two_ranks(scratch_dir: Path, e2e) -> None:
    store, trace = scratch_dir / "store", scratch_dir / "trace.jsonl"
    out = e2e.run_script(
        store,
        "hf1",
        "examples/train_hf_trainer.py",
        "--steps",
        "12",
        "--trace",
        str(trace),
        "--output-dir",
        str(scratch_dir / "out"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "run hf1: finished, 12 steps stored" in out.stdout
    e2e.assert_nothing_left(scratch_dir / ".probewire-store")
    stored = e2e.rows(
        store,
        "SELECT step, loss, grad_norm, lr FROM probewire.step_metrics "
        "FINAL WHERE run_id = 'hf1' ORDER BY step",
    )
    logged = [json.loads(line) for line in trace.read_text().splitlines()]
    assert [r["step"] for r in stored] == [t["step"] for t in logged] == list(range(12))
    for row, hf in zip(stored, logged):
        assert row["loss"] == pytest.approx(hf["loss"], rel=1e-6, abs=0), row["step"]
        assert row["grad_norm"] == pytest.approx(hf["grad_norm"], rel=REL, abs=0)
        assert row["lr"] == pytest.approx(hf["lr"], rel=REL, abs=0)
    [run] = e2e.rows(store, "SELECT status, config FROM probewire.runs FINAL WHERE run_id = 'hf1'")
    assert run["status"] == "finished"
    config = json.loads(run["config"])
    assert config["learning_rate"] == 1e-3 and config["max_steps"] == 12


def test_lightning_callback_on_two_ranks(scratch_dir: Path, e2e) -> None:
    store, trace = scratch_dir / "store", scratch_dir / "trace"
    out = e2e.run_script(
        store, "pl1", "examples/train_lightning.py", "--steps", "12", "--trace", str(trace)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "run pl1: finished, 12 steps stored" in out.stdout
    e2e.assert_nothing_left(scratch_dir / ".probewire-store")
    stored = e2e.rows(
        store,
        "SELECT step, loss, lr FROM probewire.step_metrics FINAL "
        "WHERE run_id = 'pl1' ORDER BY step",
    )
    ranks = [
        [json.loads(line) for line in (trace / f"rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    assert [r["step"] for r in stored] == list(range(12))
    for row, r0, r1 in zip(stored, *ranks):
        assert row["step"] == r0["step"] == r1["step"]
        assert row["loss"] == pytest.approx(r0["logged"], rel=REL, abs=0), row["step"]
        own = (r0["loss_sum"] + r1["loss_sum"]) / (r0["tokens"] + r1["tokens"])
        assert row["loss"] == pytest.approx(own, rel=REL, abs=0)
        assert row["lr"] == 3e-3
    [run] = e2e.rows(store, "SELECT status, config FROM probewire.runs FINAL WHERE run_id = 'pl1'")
    assert run["status"] == "finished" and json.loads(run["config"]) == {
        "lr": 3e-3,
        "width": 32,
        "probewire.scan_backend": "eager",
    }


def test_an_exception_in_a_trainer_step_marks_the_run_crashed(scratch_dir: Path, e2e) -> None:
    store = scratch_dir / "store"
    out = e2e.run_script(
        store,
        "hf2",
        "examples/train_hf_trainer.py",
        "--steps",
        "12",
        "--fail-at",
        "4",
        "--output-dir",
        str(scratch_dir / "out"),
    )
    assert out.returncode != 0 and "the command exited with code" in out.stderr
    assert "run hf2: crashed, 4 steps stored" in out.stdout, out.stdout
    e2e.assert_nothing_left(scratch_dir / ".probewire-store")
