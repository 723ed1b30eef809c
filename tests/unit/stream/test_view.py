"""Stage 2's view of a reduced step against float64 NumPy references on the ranks' own
components: the view is what production stores, and it gets its numbers from ``derive``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probewire.instrument.catalog import Comm, Grad, Label, Loss, Modality, Residual, System
from probewire.instrument.wire import RankStep
from probewire.stream.records import RankMatrix, ReducedStep
from probewire.stream.reduce import reduce_step
from probewire.stream.view import p0_view, rank_rows, rank_schema, rank_table

RANKS = 6
SOURCES = ("web", "code")


def rank_components(seed: int = 11):
    """Per rank: token losses per source, step time, FLOPs, gradient shard, embeddings."""
    rng = np.random.default_rng(seed)
    ranks = []
    for r in range(RANKS):
        losses = {
            s: rng.gamma(2.0, 1.0 + 0.3 * r + (s == "code"), size=int(n))
            for s, n in zip(SOURCES, rng.integers(0, 400, 2))
        }
        if r == 2:  # a rank with no valid token
            losses = {s: np.empty(0) for s in SOURCES}
        ranks.append(
            {
                "losses": losses,
                "tau": float(rng.uniform(0.8, 1.4)),
                "flops": 3.0e12 * (1 + r),
                "grad": rng.normal(0.0, 1e-3, 500 if r % 2 == 0 else 0),  # owners: even ranks
                "media": rng.normal(0.0, 2.0, (int(rng.integers(0, 5)), 8)),
                "text": rng.normal(0.0, 0.4, (int(rng.integers(1, 40)), 8)),
                "ratio": rng.uniform(0.1, 2.0, (2, 10)),  # (branch, token) residual ratios
            }
        )
    return ranks


def record(r: int, c: dict) -> RankStep:
    values = {
        (Loss.SUM, ()): float(sum(x.sum() for x in c["losses"].values())),
        (Loss.TOKENS, ()): float(sum(x.size for x in c["losses"].values())),
        (System.STEP_TIME, ()): c["tau"],
        (System.FLOPS, ()): c["flops"],
        (Modality.MEDIA_SUM_SQ, ()): float(np.sum(c["media"] ** 2)),
        (Modality.MEDIA_N, ()): float(c["media"].size),
        (Modality.TEXT_SUM_SQ, ()): float(np.sum(c["text"] ** 2)),
        (Modality.TEXT_N, ()): float(c["text"].size),
    }
    for s, x in c["losses"].items():
        values[(Loss.SUM, ((Label.SOURCE, s),))] = float(x.sum())
        values[(Loss.TOKENS, ((Label.SOURCE, s),))] = float(x.size)
    if c["grad"].size:
        values[(Grad.NORM_SQ, ())] = float(np.sum(c["grad"] ** 2))
    for b, branch in enumerate(("attn", "mlp")):
        labels = ((Label.BRANCH, branch), (Label.LAYER, "0"))
        values[(Residual.TOKENS, labels)] = float(c["ratio"][b].size)
        values[(Residual.name("ratio", "sum"), labels)] = float(c["ratio"][b].sum())
    return RankStep(
        run_id="v", step=0, rank=r, world_size=RANKS, host=f"h{r}", coords={"dp": r}, values=values
    )


def test_the_p0_view_matches_float64_references_of_the_ranks_components():
    ranks = rank_components()
    step = reduce_step("v", 0, RANKS, [record(r, c) for r, c in enumerate(ranks)], "all_ranks")
    view, sources, _ = p0_view(step)

    every = np.concatenate([x for c in ranks for x in c["losses"].values()])
    assert view["loss"] == pytest.approx(every.mean(), rel=1e-12)
    means = {
        r: np.concatenate(list(c["losses"].values())).mean()
        for r, c in enumerate(ranks)
        if sum(x.size for x in c["losses"].values())
    }
    assert view["loss_worst_rank_id"] == max(means, key=means.get)
    assert view["loss_worst_rank"] == pytest.approx(max(means.values()), rel=1e-12)

    grads = np.concatenate([c["grad"] for c in ranks])
    assert view["grad_norm"] == pytest.approx(np.linalg.norm(grads), rel=1e-12)

    tau = np.max([c["tau"] for c in ranks])
    assert view["step_time_s"] == tau
    assert view["tokens_per_s"] == pytest.approx(every.size / tau, rel=1e-12)
    flops = np.sum([c["flops"] for c in ranks], dtype=np.float64)
    assert view["compute_rate"] == pytest.approx(flops / (RANKS * tau), rel=1e-12)

    media = np.concatenate([c["media"].ravel() for c in ranks])
    text = np.concatenate([c["text"].ravel() for c in ranks])
    gamma = np.sqrt(np.mean(media**2)) / (np.sqrt(np.mean(text**2)) + 1e-12)
    assert view["media_scale"] == pytest.approx(gamma, rel=1e-12)

    assert set(sources) == set(SOURCES)
    for s in SOURCES:
        pooled = np.concatenate([c["losses"][s] for c in ranks])
        loss, share, n = sources[s]
        assert loss == pytest.approx(pooled.mean(), rel=1e-12)
        assert share == pytest.approx(pooled.size / every.size, rel=1e-12)
        assert n == pooled.size

    ratio = {
        b: np.concatenate([c["ratio"][i] for c in ranks]).mean()
        for i, b in enumerate(("attn", "mlp"))
    }
    weakest = min(ratio, key=ratio.get)
    assert view["residual_ratio_min"] == pytest.approx(ratio[weakest], rel=1e-12)
    assert view["residual_ratio_branch"] == f"layer 0 {weakest}"


def test_the_rank_series_for_the_culprit_rules_match_float64_references():
    """What the detectors score against each rank's history: every rank's local mean loss,
    its own-time ratio (step time less its finite exposed waits, over the other ranks'
    median), and each source's loss over the ranks other than the worst one."""
    ranks = rank_components()
    records = [record(r, c) for r, c in enumerate(ranks)]
    waits = [{"ddp_allreduce": 0.3 * r / RANKS, "all_reduce": 0.05} for r in range(RANKS)]
    waits[1]["all_reduce"] = math.nan  # a non-finite wait is not a measurement
    waits[4] = {}  # a rank that reported no collective
    for rec, w in zip(records, waits):
        rec.values.update({(Comm.WAIT, ((Label.OP, op),)): v for op, v in w.items()})
    step = reduce_step("v", 0, RANKS, records, "all_ranks")
    view, _, series = p0_view(step)

    means = {
        r: np.concatenate(list(c["losses"].values())).mean()
        for r, c in enumerate(ranks)
        if sum(x.size for x in c["losses"].values())
    }
    assert series.loss.keys() == means.keys()
    for r, mean in means.items():
        assert series.loss[r] == pytest.approx(mean, rel=1e-12)

    own = np.array(
        [c["tau"] - sum(v for v in w.values() if math.isfinite(v)) for c, w in zip(ranks, waits)],
        dtype=np.float64,
    )
    for r in range(RANKS):
        assert series.own_ratio[r] == pytest.approx(
            own[r] / np.median(np.delete(own, r)), rel=1e-12
        )

    worst = view["loss_worst_rank_id"]
    assert worst == max(means, key=means.get)
    assert series.source_loss_without_worst.keys() == set(SOURCES)
    for s in SOURCES:
        rest = np.concatenate([c["losses"][s] for r, c in enumerate(ranks) if r != worst])
        assert series.source_loss_without_worst[s] == pytest.approx(rest.mean(), rel=1e-12)

    # the formed exposed-wait share: the largest rank's summed waits (NaN kept: not finite)
    finite = [sum(w.values()) for w in waits if w and all(map(math.isfinite, w.values()))]
    assert view["comm_wait_frac"] == pytest.approx(
        max(finite) / max(c["tau"] for c in ranks), rel=1e-12
    )


def test_what_no_rank_reported_is_not_measured():
    step = reduce_step(
        "v",
        0,
        2,
        [
            RankStep(
                run_id="v", step=0, rank=r, world_size=2, host="h", coords={"dp": r}, values={}
            )
            for r in range(2)
        ],
        "all_ranks",
    )
    view, sources, _ = p0_view(step)
    for name in (
        "loss",
        "loss_worst_rank",
        "grad_norm",
        "step_time_s",
        "tokens_per_s",
        "compute_rate",
        "media_scale",
        "residual_ratio_min",
        "straggler_score",
    ):
        assert view[name] is None, name
    assert sources == {}


def test_a_non_finite_gradient_stays_visible():
    values = {(Grad.NORM_SQ, ()): math.nan}
    step = reduce_step(
        "v",
        0,
        1,
        [
            RankStep(
                run_id="v", step=0, rank=0, world_size=1, host="h", coords={"dp": 0}, values=values
            )
        ],
        "all_ranks",
    )
    assert math.isnan(p0_view(step)[0]["grad_norm"])


def test_rank_table_holds_every_rank_value_with_its_metric_and_labels():
    """One rank_metrics entry per rank, metric and label set, whatever series each rank
    sent (ranks usually send the same ones; here one sends others, in another order, and
    one sends nothing), non-finite values as they are, and the late flag of a step
    completed late: the same from the stage-2 dict (``RankMatrix.of``) and from the wire's
    arrays (``detail_from_bytes``), typed as the store's columns."""
    same = {
        (Loss.SUM, ()): 1.5,
        (Loss.TOKENS, ((Label.SOURCE, "web"),)): 3.0,
        (Comm.WAIT, ((Label.OP, "all_reduce"),)): 0.25,
    }
    per_rank = {
        0: {},
        1: {k: v * 2 for k, v in same.items()},
        2: {(Comm.WAIT, ((Label.OP, "ddp_allreduce"),)): 0.5, (Loss.SUM, ()): math.nan},
        3: dict(same),
        4: {**same, (Loss.SUM, ()): -math.inf},
    }
    records = [
        RankStep(
            run_id="c", step=9, rank=r, world_size=5, host="h", coords={"dp": r}, values=values
        )
        for r, values in per_rank.items()
    ]
    for reason, late in (("all_ranks", 0), ("late", 1)):
        step = reduce_step("c", 9, 5, records, reason)
        wire_step, wire = ReducedStep.detail_from_bytes(step.to_bytes())
        assert wire_step.per_rank == {}
        expected = sorted(
            (r, name, "|".join(f"{k}={v}" for k, v in labels), repr(value))
            for r, values in step.per_rank.items()
            for (name, labels), value in values.items()
        )
        assert len(expected) == 3 + 3 + 2 + 3
        for matrix in (RankMatrix.of(step.per_rank), wire):
            table = rank_table([rank_rows(step, matrix)])
            assert table.schema == rank_schema()
            columns = table.to_pydict()
            rows = sorted(
                (r, m, lab, repr(v))
                for r, m, lab, v in zip(
                    *(columns[c] for c in ("rank", "metric", "labels", "value"))
                )
            )
            assert rows == expected
            assert set(columns["run_id"]) == {"c"} and set(columns["step"]) == {9}
            assert columns["late"] == [late] * len(rows)
            assert ("op=ddp_allreduce", 0.5) in zip(columns["labels"], columns["value"])
