"""The detectors' rolling median / MAD / quantile (sorted windows, no NumPy per step) against
float64 NumPy on explicit windows, bit for bit (hypothesis), and their saved states."""

from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from probewire.stream.detect import RankLevels, RobustSpikeDetector, median_mad
from probewire.stream.rolling import sorted_median, sorted_median_mad, sorted_quantile

# -0.0 is left out: no window holds it (a log never returns it, nor does abs), and NumPy's
# median of [-0.0] is 0.0 (a mean of one element), its order among zeros unspecified
FINITE = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300).map(
    lambda v: v + 0.0
)
# few distinct values too, so windows hold ties
VALUES = st.one_of(FINITE, st.sampled_from([0.0, 1.0, -1.0, 2.5, 1e-300, 5e-324]))
INPUTS = st.one_of(  # what a detector is fed: log-able values, and those it must refuse
    st.floats(min_value=1e-12, max_value=1e12),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, -1e-8, 1.0, 2.0]),
)


def same(a: float | None, b: float | None) -> bool:
    """Equal to the bit (0.0 and -0.0 differ; NaN equals NaN)."""
    return (a is None and b is None) or (
        a is not None and b is not None and float(a).hex() == float(b).hex()
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(VALUES, min_size=1, max_size=120), st.floats(min_value=0.0, max_value=1.0))
def test_sorted_statistics_equal_numpy_to_the_bit(values, q):
    ordered = sorted(values)
    array = np.array(values, dtype=np.float64)
    assert same(sorted_median(ordered), float(np.median(array)))
    assert same(sorted_quantile(ordered, q), float(np.quantile(array, q)))
    for fixed in (0.0, 0.1, 0.25, 0.5, 0.75, 1.0):
        assert same(sorted_quantile(ordered, fixed), float(np.quantile(array, fixed)))
    got, want = sorted_median_mad(ordered), median_mad(array)
    assert same(got[0], want[0]) and same(got[1], want[1])


class ReferenceDetector:
    """RobustSpikeDetector's rule from an explicit list of earlier log-values and NumPy."""

    def __init__(
        self,
        window: int,
        min_history: int,
        threshold: float,
        eps: float = 1e-8,
        min_spread: float = 1e-3,
    ):
        self.window, self.min_history, self.threshold = window, min_history, threshold
        self.eps, self.min_spread, self.kept = eps, min_spread, []

    def update(self, x: float, keep: bool = True) -> tuple:
        if not math.isfinite(x) or x + self.eps <= 0.0:
            direction = 0 if math.isnan(x) else (1 if x > 0 else -1)
            return None, None, None, direction, True, len(self.kept) < self.min_history, True
        u = math.log(x + self.eps)
        win = np.array(self.kept[-self.window :], dtype=np.float64)
        if keep:
            self.kept.append(u)
        if win.size < self.min_history:
            return None, None, None, 0, False, True, False
        q = float(np.median(win))
        d = float(np.median(np.abs(win - q)))
        z = abs(0.6745 * (u - q) / max(d, self.min_spread))
        direction = (u > q) - (u < q)
        return q, d, z, direction, direction > 0 and z > self.threshold, False, False


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(INPUTS, st.sampled_from(["update", "push", "peek", "restart"])),
        min_size=1,
        max_size=160,
    ),
    st.integers(min_value=3, max_value=25),
    st.data(),
)
def test_detector_equals_numpy_on_explicit_windows(ops, window, data):
    min_history = data.draw(st.integers(min_value=3, max_value=window))
    det = RobustSpikeDetector(window=window, min_history=min_history, threshold=3.0)
    ref = ReferenceDetector(window, min_history, 3.0)
    for x, op in ops:
        if op == "restart":  # a restarted worker: the saved state is all it keeps
            state = det.to_state()
            det = RobustSpikeDetector.from_state(json.loads(json.dumps(state)))
            assert det.to_state() == state
            op = "update"
        if op == "push":
            det.push(x)
            if math.isfinite(x) and x + 1e-8 > 0.0:
                ref.kept.append(math.log(x + 1e-8))
            continue
        r = det.peek(x) if op == "peek" else det.update(x)
        q, d, z, direction, spike, warmup, nonfinite = ref.update(x, keep=op == "update")
        assert same(r.median, q) and same(r.mad, d) and same(r.z, z), (op, x)
        assert (r.direction, r.spike, r.warmup, r.nonfinite) == (
            direction,
            spike,
            warmup,
            nonfinite,
        )
    assert det.to_state()["history"] == ref.kept[-window:]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.dictionaries(
            st.integers(0, 3),
            st.one_of(
                st.floats(min_value=0.05, max_value=20.0),
                st.sampled_from([math.nan, math.inf, 0.0, -1.0, 1.0]),
            ),
        ),
        min_size=1,
        max_size=90,
    ),
    st.sets(st.integers(0, 89)),
    st.sets(st.integers(0, 89)),
)
def test_rank_levels_equal_numpy_on_explicit_histories(steps, gaps, restarts):
    window, recent, min_history = 9, 6, 4
    levels = RankLevels(window=window, recent=recent, min_history=min_history)
    series: dict[int, list[tuple[int, float]]] = {}
    step = 0
    for i, ratios in enumerate(steps):
        step += 2 if i in gaps else 1  # a step nobody reported breaks the consecutive run
        levels.update(step, ratios)
        for r, rho in ratios.items():
            if math.isfinite(rho) and rho > 0:
                series.setdefault(r, []).append((step, math.log(rho)))
        if i in restarts:
            state = levels.to_state()
            levels = RankLevels.from_state(json.loads(json.dumps(state)))
            assert levels.to_state() == state
        for r in range(4):
            values = series.get(r, [])
            history = np.array([u for _, u in values[:-recent]][-window:], dtype=np.float64)
            base = (
                None
                if history.size < min_history
                else max(1.0, math.exp(float(np.median(history))))
            )
            assert same(levels.baseline(r), base)
            for n, q in ((3, 0.0), (6, 0.1), (6, 0.25), (5, 0.5), (6, 1.0)):
                last = values[-n:]
                want = None
                if (
                    base is not None
                    and len(last) == n
                    and last[-1][0] == step
                    and last[-1][0] - last[0][0] == n - 1
                ):
                    u = np.array([v for _, v in last], dtype=np.float64)
                    want = math.exp(float(np.quantile(u, q)) - math.log(base))
                assert same(levels.held(r, n, q), want), (i, r, n, q)
