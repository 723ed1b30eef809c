"""Packed detector state: exact round trips, the JSON-list state it replaces still read."""

import json
import math

import numpy as np
import pytest

from probewire.stream.detect import (
    RankLevels,
    RobustSpikeDetector,
    pack_detectors,
    unpack_detectors,
)
from probewire.stream.packed import pack, pairs, unpack, unpairs
from probewire.stream.shifts import PeerShift


def test_pack_round_trips_every_float64_exactly_through_json():
    rng = np.random.default_rng(0)
    seqs = [rng.normal(size=n).tolist() for n in (0, 1, 7, 0, 100)]
    seqs[2][3:6] = [math.nan, math.inf, -math.inf]
    seqs[4][0] = 5e-324  # the smallest subnormal
    back = unpack(json.loads(json.dumps(pack(seqs))))
    assert [len(s) for s in back] == [len(s) for s in seqs]
    for got, want in zip(back, seqs):
        assert np.array_equal(np.array(got), np.array(want), equal_nan=True)
    assert unpack(pack([])) == []
    steps = [[(10, 0.5), (11, -1.25)], [], [(2**52, 1e300)]]
    assert unpairs(json.loads(json.dumps(pairs(steps)))) == steps


def test_unpack_refuses_lengths_that_do_not_match_the_values():
    packed = pack([[1.0, 2.0], [3.0]])
    with pytest.raises(ValueError, match="3 packed values for lengths summing to 4"):
        unpack({**packed, "lengths": [2, 2]})
    with pytest.raises(ValueError):
        unpack({**packed, "f64": "not base64!"})


def ranks_state() -> dict:
    """A RankLevels state as JSON lists (the format before ``packed``)."""
    return {
        "window": 5,
        "recent": 3,
        "min_history": 3,
        "floor": 1.0,
        "step": 9,
        "ranks": {
            "0": {"recent": [[7, 1.0], [8, 1.5], [9, 2.0]], "history": [1.0, 1.1, 0.9, 1.2]},
            "3": {"recent": [[9, 0.75]], "history": []},
        },
    }


def test_rank_levels_read_the_json_list_state_and_save_it_packed_with_the_same_levels():
    old = RankLevels.from_state(ranks_state())
    new = RankLevels.from_state(json.loads(json.dumps(old.to_state())))
    assert "ranks" not in old.to_state() and new.to_state() == old.to_state()
    for rank in (0, 3):
        assert new.baseline(rank) == old.baseline(rank)
        assert new.latest(rank) == old.latest(rank)
    assert old.baseline(0) is not None and old.baseline(3) is None  # 4 values of history, 0
    assert old.latest(3) == pytest.approx(math.exp(0.75))  # the levels are kept as logs
    new.update(10, {0: 3.0, 3: 1.0})
    old.update(10, {0: 3.0, 3: 1.0})
    assert new.to_state() == old.to_state()


def test_peer_shift_reads_the_json_list_state_and_saves_it_packed_with_the_same_scores():
    config = {"window": 6, "min_history": 3, "k": 2.0, "cap": 4.0, "h": 16.0}
    config |= {"min_scale": 0.05, "floor": None, "joint_steps": 2, "delay": 1}
    state = {
        "config": config,
        "keys": {
            "1": {
                "history": [0.1, -0.2, 0.05, 0.0],
                "recent": [0.3],
                "score": 2.5,
                "latest": True,
                "pending": [0.7],
            },
            "4": {"history": [0.0, 0.01, -0.01], "recent": [], "score": 0.0},  # older: no
        },  # latest, no pending
    }
    old = PeerShift.from_state(state)
    saved = json.loads(json.dumps(old.to_state()))
    assert saved["packed"]["keys"] == [1, 4] and saved["packed"]["score"] == [2.5, 0.0]
    new = PeerShift.from_state(saved)
    assert new.to_state() == old.to_state()
    assert unpack(saved["packed"]["pending"]) == [[0.7], []]


def rank_detectors(seed: int, ranks: int = 5) -> dict[int, RobustSpikeDetector]:
    """Per-rank spike detectors as ``SignalDetectors.rank_loss`` holds them, fed uneven
    numbers of steps (one rank none, one past its window)."""
    rng = np.random.default_rng(seed)
    out = {}
    for r in range(ranks):
        det = RobustSpikeDetector(window=8, min_history=4, threshold=6.0)
        for x in rng.lognormal(0.0, 0.3, size=[0, 3, 8, 12, 5][r % 5]):
            det.update(float(x))
        out[r * 7] = det
    return out


def test_per_rank_spike_detectors_save_packed_and_score_the_next_step_the_same():
    """One configuration and one packed array for every rank's window (JSON through and
    back, as the store keeps it): the same windows bit for bit, and each detector scores the
    next value as the original does; the dict-per-rank state saved before is still read."""
    live = rank_detectors(1)
    saved = json.loads(json.dumps(pack_detectors(live)))
    assert set(saved) == {"packed"} and saved["packed"]["ranks"] == list(live)
    old = json.loads(json.dumps({str(r): d.to_state() for r, d in live.items()}))
    for state in (saved, old):
        back = unpack_detectors(state)
        assert list(back) == list(live)
        for rank, det in live.items():
            assert back[rank].to_state() == det.to_state()
            assert back[rank].update(1.7) == rank_detectors(1)[rank].update(1.7)
    assert unpack_detectors(json.loads(json.dumps(pack_detectors({})))) == {}


def test_spike_detectors_of_different_configurations_keep_a_state_each():
    live = rank_detectors(2)
    live[99] = RobustSpikeDetector(window=20, min_history=4, threshold=5.0)
    saved = pack_detectors(live)
    assert "packed" not in saved and saved["99"]["window"] == 20
    assert {r: d.to_state() for r, d in unpack_detectors(saved).items()} == {
        r: d.to_state() for r, d in live.items()
    }
