"""The worker's full garbage collections (``stream.collector``): when they are due, and
what ``start`` does to the process (in a subprocess: it changes the interpreter's
collector). A worker's tick collecting only while its step tier is idle:
``test_worker_acks``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from probewire.instrument.plumbing import ConfigError
from probewire.stream.collector import CollectorConfig, IdleCollector


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _started(every_s: float = 10.0, max_s: float = 60.0) -> tuple[IdleCollector, _Clock, list]:
    clock, calls = _Clock(), []
    collector = IdleCollector(CollectorConfig(every_s=every_s, max_s=max_s), clock, calls.append)
    collector.collect = lambda: calls.append(clock.now)
    collector.started, collector.last = True, clock.now  # as ``start`` leaves it
    return collector, clock, calls


def test_a_collection_waits_for_every_s_and_an_idle_tier_and_no_longer_than_max_s() -> None:
    collector, clock, calls = _started(every_s=10, max_s=60)
    clock.now += 9.9
    assert not collector.run(busy=False)  # too soon
    clock.now += 0.1
    assert not collector.run(busy=True)  # due, but a step is in hand
    assert collector.run(busy=False) and calls == [110.0]
    clock.now += 59.9
    assert not collector.run(busy=True)  # the tier never idle: waits up to max_s ...
    clock.now += 0.1
    assert collector.run(busy=True) and calls == [110.0, 170.0]  # ... then collects anyway
    assert collector.collections == 2


def test_a_collector_not_started_or_switched_off_never_collects() -> None:
    calls: list[float] = []
    idle = IdleCollector(CollectorConfig(), lambda: 1e9, lambda: calls.append(1))
    assert not idle.run(busy=False)  # built inside another process (a test): hands off
    off = IdleCollector(CollectorConfig(every_s=0), lambda: 1e9, lambda: calls.append(1))
    off.start()  # every_s 0: CPython's own schedule, untouched
    assert not off.started and not off.run(busy=False) and calls == []


@pytest.mark.parametrize(
    ("every_s", "max_s", "field"), [(-1, 60, "every_s"), (4000, 5000, "every_s"), (10, 5, "max_s")]
)
def test_bad_collector_settings_name_the_field(every_s: float, max_s: float, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        CollectorConfig(every_s=every_s, max_s=max_s)


def test_start_freezes_the_process_and_leaves_its_cycles_to_the_collector() -> None:
    """After ``start``: what existed is frozen, allocation counts no longer run a full
    collection however much cyclic garbage is made, and ``run`` collects it."""
    script = textwrap.dedent(
        """
        import gc
        from probewire.stream.collector import NEVER, CollectorConfig, IdleCollector

        clock = [0.0]
        collector = IdleCollector(CollectorConfig(every_s=1, max_s=5), lambda: clock[0])
        collector.start()
        full = gc.get_stats()[2]["collections"]
        for _ in range(200_000):  # cyclic garbage: only a collection frees it
            cycle = []
            cycle.append(cycle)
        automatic = gc.get_stats()[2]["collections"] - full
        clock[0] = 1.0
        ran = collector.run(busy=False)
        print(gc.get_freeze_count() > 1000, gc.get_threshold()[2] == NEVER, automatic,
              ran, gc.get_stats()[2]["collections"] - full, gc.get_stats()[2]["collected"] > 0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["True", "True", "0", "True", "1", "True"]
