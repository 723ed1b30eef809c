"""One rank's absurd count at one step, on the real broker and the real ClickHouse engine:
that rank's message is a dead letter with its reason, the step is reduced without it
(flagged by ranks_reporting), and every other rank's data and every later step are stored
exactly (before the bounds, a token count of 1e20 entered the run's cumulative UInt64
token count and every later step was refused by the store)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import pytest
from test_stream_pipeline import settings_for, wait_finished

from probewire.deploy.stack import LocalStack
from probewire.instrument.catalog import Loss
from probewire.stream.testing import SimRun, send

pytestmark = pytest.mark.integration

STEPS = 12
# (step, rank) -> the token count that rank claims; -0.0 is a legal count of zero
POISON = {(3, 1): 1e20, (5, 2): 1e300, (7, 0): float(2**64)}
NEGATIVE_ZERO = (9, 3)


@dataclass(slots=True, kw_only=True)
class PoisonRun(SimRun):
    poison: dict[tuple[int, int], float] = field(default_factory=dict)

    def components(self, step: int, rank: int) -> dict[str, float] | None:
        parts = SimRun.components(self, step, rank)
        if (step, rank) in self.poison:
            parts[Loss.TOKENS] = self.poison[(step, rank)]
        if (step, rank) == NEGATIVE_ZERO:
            parts[Loss.SUM], parts[Loss.TOKENS] = 0.0, -0.0
        return parts


@pytest.fixture(scope="module")
def poisoned(kafka_bootstrap, tmp_path_factory, read_store):
    base = tmp_path_factory.mktemp("poison")
    run = PoisonRun(run_id=f"poison-{uuid.uuid4().hex[:6]}", world_size=4, steps=STEPS, seed=3)
    run.poison = dict(POISON)
    stack = LocalStack(settings_for(base / "store"), base / "run")
    try:
        stack.use_broker(kafka_bootstrap)
        stack.start_worker()
        send(run, kafka_bootstrap, stack.settings.topics.metrics, range(STEPS))
        wait_finished(stack, run.run_id)
        time.sleep(1.5)  # the dead-letter agent batches for up to 1 s
    finally:
        stack.stop()
    q = f"FROM probewire.step_metrics FINAL WHERE run_id = '{run.run_id}' ORDER BY step"
    steps = read_store(
        base / "store", f"SELECT step, tokens, step_tokens, loss, ranks_reporting {q}"
    )
    letters = read_store(base / "store", "SELECT reason FROM probewire.dead_letters FINAL")
    return run, steps, letters


def _good(run: PoisonRun, step: int) -> list[dict[str, float]]:
    return [run.components(step, r) for r in range(run.world_size) if (step, r) not in POISON]


def test_every_step_is_stored_and_other_ranks_exactly(poisoned):
    """All 12 steps are stored; at a poisoned step the other three ranks' tokens exactly
    and their loss (to 1e-9, the pipeline test's tolerance), with ranks_reporting 3; the cumulative token count of every later step is the
    sum of the good ranks' counts; the -0.0 rank is a rank with no token."""
    run, steps, _ = poisoned
    assert [row["step"] for row in steps] == list(range(STEPS))
    total = 0
    for row in steps:
        good = _good(run, row["step"])
        tokens = sum(int(p[Loss.TOKENS]) for p in good)
        total += tokens
        assert row["step_tokens"] == tokens and row["tokens"] == total, row
        expected = sum(p[Loss.SUM] for p in good) / tokens
        assert row["loss"] == pytest.approx(expected, rel=1e-9, abs=0), row
        assert row["ranks_reporting"] == (3 if any(s == row["step"] for s, _ in POISON) else 4)


def test_each_bad_message_is_a_dead_letter_with_its_reason(poisoned):
    """Exactly the three poisoned messages are dead letters, each naming loss.tokens and
    its bound."""
    _, _, letters = poisoned
    reasons = [
        r["reason"] for r in letters if "count loss.tokens must be finite and in" in r["reason"]
    ]
    assert len(reasons) == len(POISON), letters
    for value in POISON.values():
        assert any(repr(value) in reason for reason in reasons), (value, reasons)
