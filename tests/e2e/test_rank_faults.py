"""Issue 38's rank faults on real gloo DDP ranks (4 ranks: the peer rules need 3 or more)
through the real pipeline (OTLP -> Kafka -> Faust -> chdb): one rank's labels shuffled from
step 120 (a broken data shard) pages within 20 steps naming that rank; a rank slowed 1.3x
for 20 steps; and the same heavier run on a host loaded by a CPU burner pages nothing.

Slow (4 ranks on the shared 2-core host, several minutes): ``-m slow``. The fast versions on
simulated ranks are ``tests/integration/test_detector_pipeline.py``.
"""

from __future__ import annotations

import os

import pytest

from probewire.deploy.demo.faults import demo_train_args
from probewire.deploy.demo.gallery import Gallery, read_gallery

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DB = "probewire"
WINDOW = 50
FAULT = 120
HEAVY = ["--batch-size", "16", "--micro-batches", "4"]
EARLY = 16  # the tiny demo's real early co-spike (``test_demo_pages.EARLY``)
RUNS = {  # run id: (ranks, steps, --fault texts, extra train args, CPU burners)
    "label-shuffle": (4, 170, [f"label-shuffle@{FAULT}:rank=2"], [], 0),
    "straggler-13": (4, 170, [f"straggler@{FAULT}:rank=1,factor=1.3,duration=20"], HEAVY, 0),
    "loaded-host": (4, 170, [], HEAVY, 1),
}


@pytest.fixture(scope="module")
def alerts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple]]:
    base = tmp_path_factory.mktemp("rank-faults")
    with Gallery(
        base,
        window=WINDOW,
        database=DB,
        bootstrap=os.environ.get("KAFKA_BOOTSTRAP"),
        stage2={"run_idle_s": 20.0},
    ) as g:
        for run_id, (ranks, steps, faults, extra, burner) in RUNS.items():
            result = g.run(
                run_id,
                ranks=ranks,
                steps=steps,
                burner=burner,
                train_args=demo_train_args(faults) + extra,
            )
            assert result.steps_written == steps, run_id
    sql = read_gallery(
        g.store,
        {
            "alerts": f"SELECT run_id, step, signal, culprit, message FROM {DB}.alerts FINAL "
            "ORDER BY run_id, step, signal"
        },
        [],
        DB,
    )["sql"]["alerts"]
    got = {
        run: [(a["step"], a["signal"], a["culprit"]) for a in sql if a["run_id"] == run]
        for run in RUNS
    }
    print("pages:", got)
    return got


def after_early(pages: list[tuple]) -> list[tuple]:
    """The pages after the demo data's own early co-spike (step 16)."""
    return [p for p in pages if not (p[0] == EARLY and p[1] == "cospike")]


def test_one_ranks_shuffled_labels_page_within_20_steps_naming_it(alerts):
    got = after_early(alerts["label-shuffle"])
    assert got and all(c == "rank 2" for _, _, c in got), got
    assert FAULT <= got[0][0] < FAULT + 20, got
    assert {s for _, s, _ in got} <= {"loss_rank_shift", "loss_worst_rank"}, got


def test_a_rank_13x_slower_for_20_steps_pages_within_20_steps_naming_it(alerts):
    got = after_early(alerts["straggler-13"])
    assert got and {(s, c) for _, s, c in got} <= {("step_time", "rank 1"), ("compute_rate", "")}
    assert FAULT <= got[0][0] < FAULT + 20, got


def test_the_heavier_run_under_a_cpu_burner_pages_nothing(alerts):
    assert after_early(alerts["loaded-host"]) == []
