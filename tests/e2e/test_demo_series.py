"""Done-when of issue 18: `probewire demo --preset full --steps 60` stores a non-null value
of every formed series (``instrument.series.FORMED``) on every step where its components'
cadence says it exists: step-tier series on every step, scan-tier ones on the scan steps
of the demo's ``--p1-every``. The column list comes from the registry, which a unit test
holds equal to the schema's columns."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from probewire.deploy.demo.train import _parse
from probewire.instrument.catalog import Tier
from probewire.stream.series import FORMED

pytestmark = pytest.mark.integration

STEPS = 60


def _sql(store: Path, query: str) -> list[dict]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "probewire.deploy.cli",
            "sql",
            "--store",
            str(store),
            "--format",
            "json",
            query,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def full_demo() -> Iterator[Path]:
    """One ``probewire demo --preset full`` run of ``STEPS`` steps: its store (in a short
    path outside pytest's tmp tree, as ``scratch_dir``: sockets and logs)."""
    scratch_dir = Path(tempfile.mkdtemp(prefix="pw-"))
    store = scratch_dir / "store"
    demo = subprocess.run(
        [
            sys.executable,
            "-m",
            "probewire.deploy.cli",
            "demo",
            "--preset",
            "full",
            "--steps",
            str(STEPS),
            "--store",
            str(store),
            "--work-dir",
            str(scratch_dir / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stderr[-2000:]
    (scratch_dir / "demo.stderr").write_text(demo.stderr)
    yield store
    shutil.rmtree(scratch_dir, ignore_errors=True)


def test_the_full_demo_stores_every_formed_series_at_its_cadence(full_demo: Path) -> None:
    store = full_demo
    scan_every = _parse(
        [
            "--rank",
            "0",
            "--world-size",
            "1",
            "--master-port",
            "1",
            "--run-id",
            "r",
            "--steps",
            "1",
            "--bootstrap",
            "b",
        ]
    ).p1_every
    due = {Tier.STEP: set(range(STEPS)), Tier.SCAN: set(range(0, STEPS, scan_every))}
    missing = {}
    for table in sorted({s.table for s in FORMED}):
        series = [s for s in FORMED if s.table == table]
        columns = ", ".join(f"countIf({s.column} IS NOT NULL) > 0 AS `{s.column}`" for s in series)
        rows = _sql(
            store,
            f"SELECT step, {columns} FROM probewire.{table} FINAL GROUP BY step ORDER BY step",
        )
        present = {s.column: {r["step"] for r in rows if r[s.column]} for s in series}
        for s in series:
            lacking = sorted(due[s.tier] - present[s.column])
            if lacking:
                missing[f"{table}.{s.column}"] = lacking[:10]
    assert not missing, missing


def test_the_modality_token_share_equals_the_ranks_counts(full_demo: Path) -> None:
    """pi per modality (seeds 001 §9) on the media preset, every step: the stored map equals
    Σ_r tokens{μ} / Σ_μ Σ_r tokens{μ} over the ranks' own counts (``rank_metrics``; every
    step of the run is a warm-up step, so every step's ranks are retained), in float64."""
    import numpy as np

    stored = {
        r["step"]: r["modality_token_share"]
        for r in _sql(
            full_demo,
            "SELECT step, modality_token_share FROM probewire.step_metrics FINAL ORDER BY step",
        )
    }
    counts: dict[int, dict[str, list[float]]] = {}
    for r in _sql(
        full_demo,
        "SELECT step, labels, value FROM probewire.rank_metrics FINAL "
        "WHERE metric = 'modality.tokens' ORDER BY step, labels, rank",
    ):
        modality = dict(kv.split("=", 1) for kv in r["labels"].split("|"))["modality"]
        counts.setdefault(r["step"], {}).setdefault(modality, []).append(r["value"])
    assert sorted(stored) == list(range(STEPS)) and sorted(counts) == list(range(STEPS))
    for step, by_modality in counts.items():
        total = np.sum([np.sum(v, dtype=np.float64) for v in by_modality.values()])
        reference = {m: np.sum(v, dtype=np.float64) / total for m, v in by_modality.items()}
        assert set(reference) == {"media", "text"}, step
        assert stored[step] == pytest.approx(reference, rel=1e-12), step


def test_the_demo_logs_its_own_metric_and_shows_progress_while_it_trains(full_demo: Path):
    """The demo's loop logs ``data/pad_fraction`` with ``s.log`` (reduction mean): stored
    on every step as the float64 mean of the two ranks' logged values (their user.mean
    points, retained per rank), in (0, 1); and its stderr (a pipe) showed the steps stored
    growing while it trained."""
    import re

    import numpy as np

    name = "data/pad_fraction"
    stored = _sql(
        full_demo,
        "SELECT step, value, reduction FROM probewire.user_metrics FINAL "
        f"WHERE name = '{name}' ORDER BY step",
    )
    assert [r["step"] for r in stored] == list(range(STEPS))
    ranks: dict[int, list[float]] = {}
    for r in _sql(
        full_demo,
        "SELECT step, value FROM probewire.rank_metrics FINAL "
        f"WHERE metric = 'user.mean' AND labels = 'name={name}' ORDER BY step, rank",
    ):
        ranks.setdefault(r["step"], []).append(r["value"])
    for row in stored:
        values = ranks[row["step"]]
        assert len(values) == 2 and row["reduction"] == "mean"
        assert row["value"] == pytest.approx(np.mean(values, dtype=np.float64), rel=1e-15)
        assert 0 < row["value"] < 1
    stderr = (full_demo.parent / "demo.stderr").read_text()
    shown = [
        int(n) for n in re.findall(r"^probewire: run \S+: (\d+)/60 steps stored", stderr, re.M)
    ]
    assert len(shown) >= 2 and shown == sorted(shown) and shown[-1] == STEPS, stderr[-2000:]
