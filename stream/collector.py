"""When a worker collects its cyclic garbage: between steps, not in the middle of one.

CPython collects its oldest generation whenever enough objects have outlived the younger
two, and a full collection walks every tracked container with the GIL held. In
``benchmarks/fanin.py`` at 2,048 ranks the store owner ran one every ~6 s, each 45 ms at
first and 165 ms once the per-rank detectors' windows had filled (they walk every float
in every window), nearly all of them finding no garbage, and landing inside a P0 step's
reduction at random. Trainers at this scale take the same pause out of their step for the
same reason (torchtitan's ``GarbageCollection``, Megatron-LM's ``--manual-gc``). Here:

- ``freeze``: once a worker is up, what it made while starting (modules, the app, the
  broker and store clients) moves to CPython's permanent generation and is never walked
  again: the full collection above fell from ~80 to ~35 ms;
- the oldest generation is no longer collected by allocation counts (the younger two
  still are: a few ms each, at any time);
- ``IdleCollector``: the worker collects it when the step tier has nothing in hand, at most
  every ``every_s`` seconds, and past ``max_s`` in any case (a tier that is never idle
  still frees its cycles). ``every_s`` 0 leaves CPython's own schedule as it was.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass

from probewire.instrument.plumbing import check

__all__ = ["CollectorConfig", "IdleCollector"]

NEVER = 2**31 - 1  # a generation threshold allocation counts never reach (a C int)


@dataclass(kw_only=True, slots=True)
class CollectorConfig:
    """The oldest generation's collections (``stream.gc``)."""

    every_s: float = 10.0  # at most this often, when the step tier is idle; 0: CPython's own
    max_s: float = 60.0  # at least this often, idle or not

    def __post_init__(self) -> None:
        check(0 <= self.every_s <= 3600, "every_s", "must lie in [0, 3600]")
        check(self.max_s >= self.every_s, "max_s", f"must be >= every_s ({self.every_s})")


@dataclass(slots=True)
class IdleCollector:
    """Collects the oldest generation when ``due``, once ``start`` took it over (the worker
    process calls it; a worker built inside another process, a test's, leaves that
    process's collections alone). Clock and collection injected for tests."""

    config: CollectorConfig
    clock: Callable[[], float] = time.monotonic
    collect: Callable[[], object] = gc.collect
    started: bool = False
    last: float = 0.0
    collections: int = 0

    def start(self) -> None:
        """Freeze what exists and take the oldest generation off allocation counts; nothing
        when ``every_s`` is 0."""
        if self.config.every_s == 0:
            return
        gc.collect()  # what starting left unreachable is not frozen with the rest
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, NEVER)
        self.started, self.last = True, self.clock()

    def due(self, busy: bool) -> bool:
        """``every_s`` passed since the last collection and the step tier is idle, or
        ``max_s`` passed."""
        if not self.started:
            return False
        waited = self.clock() - self.last
        return waited >= self.config.max_s or (waited >= self.config.every_s and not busy)

    def run(self, busy: bool) -> bool:
        """Collect the oldest generation if ``due``; whether it did."""
        if not self.due(busy):
            return False
        self.collect()
        self.last = self.clock()
        self.collections += 1
        return True
