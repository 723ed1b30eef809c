"""What saving a run's per-rank detector state costs a store write, against the ranks.

    python benchmarks/state.py [--ranks 512,2048,16384] [--repeat 5]

Stage 2 saves each run's detector state with every store write (``RunPipeline.to_state``,
``stream_state``): ``to_state`` on the event loop, ``json.dumps`` in the writer thread, both
on the paging path. The per-rank detectors hold a window of floats for every rank: a
``RankLevels`` (window 100, recent 40: the straggler and loss levels) and a ``PeerShift``
(window 100, 10 recent: a rank's loss shift), here with full windows of seeded random
values, built from a state in the JSON-list form earlier workers saved (so this also reads
it), and a ``RobustSpikeDetector`` per rank (``SignalDetectors.rank_loss``: the loss spike
rule's window of 100 log-values), from the dict-per-rank state saved before
``pack_detectors``. Printed per N and detector, median of ``--repeat``: to_state ms, dumps ms, loads +
from_state ms (a restart), the JSON's MB; each state is checked to round-trip exactly.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from probewire.stream.detect import (
    RankLevels,
    RobustSpikeDetector,
    pack_detectors,
    unpack_detectors,
)
from probewire.stream.shifts import PeerShift


class RankLoss:
    """``SignalDetectors.rank_loss`` alone: its state as the run's state saves it."""

    def __init__(self, detectors: dict[int, RobustSpikeDetector]) -> None:
        self.detectors = detectors

    def to_state(self) -> dict[str, Any]:
        return pack_detectors(self.detectors)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RankLoss:
        return cls(unpack_detectors(state))


def levels(n: int, rnd: random.Random) -> RankLevels:
    recent = {r: [[500 - i, rnd.random()] for i in range(40)][::-1] for r in range(n)}
    return RankLevels.from_state(
        {
            "window": 100,
            "recent": 40,
            "min_history": 20,
            "floor": 1.0,
            "step": 500,
            "ranks": {
                str(r): {"recent": recent[r], "history": [rnd.random() for _ in range(100)]}
                for r in range(n)
            },
        }
    )


def shift(n: int, rnd: random.Random) -> PeerShift:
    config = {"window": 100, "min_history": 20, "k": 2.0, "cap": 4.0, "h": 16.0}
    config |= {"min_scale": 0.05, "floor": None, "joint_steps": 10, "delay": 0}
    keys = {
        str(r): {
            "history": [rnd.random() for _ in range(100)],
            "recent": [rnd.random() for _ in range(10)],
            "score": 0.5,
            "latest": False,
            "pending": [],
        }
        for r in range(n)
    }
    return PeerShift.from_state({"config": config, "keys": keys})


def rank_loss(n: int, rnd: random.Random) -> RankLoss:
    config = {"window": 100, "min_history": 20, "threshold": 6.0, "eps": 1e-8}
    config |= {"min_spread": 1e-3, "early_history": None, "early_threshold": None}
    ranks = {str(r): config | {"history": [rnd.random() for _ in range(100)]} for r in range(n)}
    return RankLoss.from_state(ranks)


Detectors = RankLevels | PeerShift | RankLoss


def restore(kind: type[Detectors], text: str) -> Detectors:
    return kind.from_state(json.loads(text))


def ms(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="512,2048,16384")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for n in (int(x) for x in args.ranks.split(",")):
        rnd = random.Random(0)
        for detector in (levels(n, rnd), shift(n, rnd), rank_loss(n, rnd)):
            to_state, state = ms(detector.to_state, args.repeat)
            dumps, text = ms(functools.partial(json.dumps, state), args.repeat)
            kind = type(detector)
            loads, back = ms(functools.partial(restore, kind, text), args.repeat)
            assert back.to_state() == json.loads(text), f"{kind.__name__}: not exact"
            print(
                f"state ranks {n} {kind.__name__} to_state_ms {to_state:.1f} dumps_ms "
                f"{dumps:.1f} restore_ms {loads:.1f} mb {len(text) / 1e6:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
