"""The structure P0 pages and the job-state rule: the weakest residual branch (R_b), expert
MaxVio held over consecutive steps, the media scale, and missing ranks that persist.

p0_view's residual fields are checked against a float64 NumPy reference on per-rank
components with uneven token counts and a rank that saw no token of one branch."""

from __future__ import annotations

import numpy as np
import pytest

from probewire.instrument.wire import RankStep, series_key
from probewire.stream.reduce import reduce_step
from probewire.stream.signals import DetectorConfig, SignalDetectors
from probewire.stream.stage2 import p0_view

BRANCHES = [("0", "attn"), ("0", "mlp"), ("1", "attn"), ("1", "mlp")]


def residual_step(per_rank: list[dict[tuple[str, str], tuple[float, float, float, float]]]):
    """per rank: (layer, branch) -> (tokens, Σ R_b, Σ N_s, Σ N_b) over its valid tokens."""
    recs = []
    for r, branches in enumerate(per_rank):
        values = {series_key("loss.sum"): 1.0, series_key("loss.tokens"): 1.0}
        for (layer, branch), (n, ratio, ns, nb) in branches.items():
            lab = {"layer": layer, "branch": branch}
            values[series_key("residual.tokens", lab)] = n
            values[series_key("residual.ratio_sum", lab)] = ratio
            values[series_key("residual.stream_norm_sum", lab)] = ns
            values[series_key("residual.branch_norm_sum", lab)] = nb
        recs.append(
            RankStep(
                run_id="r",
                step=0,
                rank=r,
                world_size=len(per_rank),
                host="h",
                coords={"dp": r},
                values=values,
            )
        )
    return reduce_step("r", 0, len(per_rank), recs, "all_ranks")


def test_weakest_branch_is_the_token_weighted_mean_over_ranks():
    rng = np.random.default_rng(3)
    per_rank = []
    for r in range(3):
        comps = {}
        for b in BRANCHES:
            if r == 2 and b == ("1", "mlp"):
                continue  # this rank saw no token of that branch: no measurement
            n = float(rng.integers(1, 50))
            ratios = rng.uniform(1e-4, 0.5, int(n))
            comps[b] = (n, ratios.sum(), rng.uniform(1, 9) * n, rng.uniform(0.1, 1) * n)
        per_rank.append(comps)
    view, _, series = p0_view(residual_step(per_rank))
    # reference: Σ over ranks of the sums / Σ of the token counts, per branch, in float64
    means = {}
    for b in BRANCHES:
        parts = [np.array(c[b], dtype=np.float64) for c in per_rank if b in c]
        total = np.sum(parts, axis=0)
        means[b] = total[1:] / total[0]
    weakest = min(means, key=lambda b: means[b][0])
    assert view["residual_ratio_branch"] == f"layer {weakest[0]} {weakest[1]}"
    assert view["residual_ratio_min"] == pytest.approx(means[weakest][0], rel=1e-12)
    assert view["residual_stream_norm"] == pytest.approx(means[weakest][1], rel=1e-12)
    assert view["residual_branch_norm"] == pytest.approx(means[weakest][2], rel=1e-12)
    # every branch's R_b, as the upper-side rule (directions) reads it
    assert series.branch_ratio.keys() == {f"layer {layer} {b}" for layer, b in BRANCHES}
    for (layer, b), mean in means.items():
        assert series.branch_ratio[f"layer {layer} {b}"] == pytest.approx(mean[0], rel=1e-12)


def test_no_residual_measurement_is_none_not_zero():
    view, _, _ = p0_view(residual_step([{}, {}]))
    assert view["residual_ratio_min"] is None and view["residual_ratio_branch"] is None


def base_view(**kw) -> dict:
    view = {
        "loss": None,
        "grad_norm": None,
        "ranks_missing": [],
        "loss_worst_rank": None,
        "step_time_s": None,
        "complete_reason": "all_ranks",
    }
    return {**view, **kw}


def pages(det: SignalDetectors, views: list[dict], signal: str) -> list[tuple[int, str]]:
    out = []
    for step, view in enumerate(views):
        _, found = det.observe(step, view, {})
        out += [(step, f.culprit) for f in found if f.signal == signal and f.page]
    return out


CFG = DetectorConfig(window=5, rearm_steps=0)  # rearm 0: the gate passes every page


def test_residual_scale_pages_below_bf16_precision_and_names_the_branch():
    threshold = CFG.residual_ratio_min
    assert threshold == 2.0**-8
    views = [
        base_view(residual_ratio_min=v, residual_ratio_branch="layer 1 mlp")
        for v in (0.2, threshold, None, threshold * 0.999, 6e-4)
    ]
    assert pages(SignalDetectors(CFG), views, "residual_scale") == [
        (3, "layer 1 mlp"),
        (4, "layer 1 mlp"),
    ]


def test_media_scale_pages_below_its_minimum():
    views = [base_view(media_scale=v) for v in (9.9, None, 0.1, 0.098)]
    assert pages(SignalDetectors(CFG), views, "media_scale") == [(3, "media projector")]


def warm_views(n: int) -> list[dict]:
    """Steps whose loss and G2 warm the detectors up (warm-up = the detector window)."""
    return [base_view(loss=2.0 + 0.01 * (i % 3), grad_norm=1.0 + 0.01 * (i % 2)) for i in range(n)]


def test_maxvio_pages_on_the_kth_consecutive_step_after_warm_up():
    vio = [None] * 5 + [3.0, 3.0, 0.5, 3.0, 3.0, 3.0, 3.0]
    views = [
        dict(v, moe_maxvio=m, moe_maxvio_layer="layer 1") for v, m in zip(warm_views(len(vio)), vio)
    ]
    # steps 5-6 are above but the run breaks at 7; 8, 9, 10 make three: the page is at 10
    assert pages(SignalDetectors(CFG), views, "moe_maxvio") == [(10, "layer 1"), (11, "layer 1")]


def test_maxvio_does_not_page_while_the_detectors_warm_up():
    views = [dict(v, moe_maxvio=3.0, moe_maxvio_layer="layer 0") for v in warm_views(5)]
    assert pages(SignalDetectors(CFG), views, "moe_maxvio") == []


def test_maxvio_run_survives_a_restart():
    views = [
        dict(v, moe_maxvio=m, moe_maxvio_layer="layer 1")
        for v, m in zip(warm_views(9), [None] * 6 + [3.0, 3.0, 3.0])
    ]
    det = SignalDetectors(CFG)
    for step, view in enumerate(views[:8]):
        det.observe(step, view, {})
    again = SignalDetectors.from_state(CFG, det.to_state())
    _, found = again.observe(8, views[8], {})
    assert [f.signal for f in found if f.page] == ["moe_maxvio"]


def test_one_step_closed_early_without_a_rank_is_an_anomaly_a_second_one_pages():
    det = SignalDetectors(CFG)
    views = [
        base_view(ranks_missing=[1], complete_reason="later_step"),
        base_view(),
        base_view(ranks_missing=[1], complete_reason="later_step"),
        base_view(ranks_missing=[1], complete_reason="later_step"),
    ]
    found = [det.observe(s, v, {})[1] for s, v in enumerate(views)]
    missing = [[(f.page, f.culprit) for f in fs if f.signal == "ranks_missing"] for fs in found]
    assert missing == [[(False, "ranks 1")], [], [(False, "ranks 1")], [(True, "ranks 1")]]


def test_the_page_does_not_depend_on_how_the_step_closed():
    for reason in ("deadline", "later_step"):
        det = SignalDetectors(CFG)
        found = [
            det.observe(s, base_view(ranks_missing=[0, 3], complete_reason=reason), {})[1]
            for s in range(2)
        ]
        assert [[(f.page, f.culprit) for f in fs] for fs in found] == [
            [(False, "ranks 0,3")],
            [(True, "ranks 0,3")],
        ], reason
