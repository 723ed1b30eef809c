"""The demo's checkpoints are scored by the evaluator service and stored by the stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from probewire.deploy.demo.run import run_demo
from probewire.deploy.settings import ClickHouseSettings, Settings

pytestmark = pytest.mark.integration


def test_checkpoint_evaluations_reach_clickhouse_and_bpb_falls(tmp_path: Path, read_store):
    store = tmp_path / "store"
    settings = Settings(clickhouse=ClickHouseSettings(url="chdb:///" + str(store).lstrip("/")))
    result = run_demo(
        settings,
        ranks=2,
        steps=300,
        work_dir=tmp_path / "run",
        evaluate_every=100,
        show_progress=False,
    )
    rows = read_store(
        store,
        "SELECT step, tokens, value, reference, dataset_version, "
        "tokenizer_version FROM probewire.evaluations FINAL "
        f"WHERE run_id = '{result.run_id}' AND suite = 'heldout' "
        "AND metric = 'bpb' AND weights_stream = 'raw' ORDER BY step",
    )
    assert [r["step"] for r in rows] == [99, 199, 299]
    bpb = [r["value"] for r in rows]
    assert bpb[0] > bpb[1] > bpb[2], bpb
    assert all(r["tokens"] > 0 and r["dataset_version"] and r["tokenizer_version"] for r in rows)
    assert [r["tokens"] for r in rows] == sorted(r["tokens"] for r in rows)
    screen = read_store(
        store,
        "SELECT step, heldout_bpb FROM probewire.first_screen "
        f"WHERE run_id = '{result.run_id}' AND step IN (150, 299) "
        "ORDER BY step",
    )
    assert screen[0]["heldout_bpb"] == pytest.approx(bpb[0])  # latest evaluation at or before
    assert screen[1]["heldout_bpb"] == pytest.approx(bpb[2])
