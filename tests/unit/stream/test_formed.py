"""The formed series (``stream.formed``, issue 18) against float64 NumPy references on the
ranks' own data: each rank sends its components as the probes do, stage 1 reduces them,
and the view's value must equal the seeds' formula over the pooled elements. Edge cases:
an empty rank, uneven tokens and padding, non-finite elements, parameter shards, an
expert layer without a valid token, a tensor scanned only as a parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probewire.instrument.catalog import (
    GRAD_GROUPS,
    Attn,
    Comm,
    Grad,
    Label,
    Modality,
    Moe,
    Output,
    System,
    Tensor,
)
from probewire.instrument.wire import RankStep
from probewire.stream.formed import formed_series, grad_group_rows
from probewire.stream.reduce import reduce_step
from probewire.stream.series import FORMED
from probewire.stream.view import p0_view

RANKS = 4
REL = 1e-12


def formed(step) -> dict:
    """The step's formed series as stage 2's P0 view holds them."""
    view = p0_view(step).view
    return {s.column: view[s.column] for s in FORMED if s.table == "step_metrics"}


def _grad_components(g: np.ndarray, labels: tuple) -> dict:
    finite = g[np.isfinite(g)]
    return {
        (Grad.ABS_SUM, labels): float(np.abs(finite).sum()),
        (Grad.ABS_MAX, labels): float(np.abs(finite).max(initial=0.0)),
        (Grad.ZEROS, labels): float((g == 0).sum()),
        (Grad.ELEMENTS, labels): float(g.size),
        (Grad.NONFINITE, labels): float((~np.isfinite(g)).sum()),
    }


def make_ranks(seed: int = 3) -> list[dict]:
    rng = np.random.default_rng(seed)
    ranks = []
    for r in range(RANKS):
        grads = {}
        for group in GRAD_GROUPS:  # shards of each group; rank 1 owns no parameter
            g = rng.normal(0, 1e-3, 0 if r == 1 else int(rng.integers(50, 300)))
            if g.size:
                g[rng.random(g.size) < (0.4 if group == "embedding" else 0.05)] = 0.0
            if r == 2 and group == "expert":
                g[:3] = [np.nan, np.inf, -np.inf]
            grads[group] = g
        positions = int(rng.integers(3, 9))  # uneven tokens; ~30% padding
        logits = rng.normal(0, 2.0, (positions, 11))
        logits[0, :2] = 5.0  # a top-2 tie
        valid = rng.random(positions) > 0.3
        valid[0] = True
        ranks.append(
            {
                "grads": grads,
                "logits": logits,
                "valid": valid,
                "waits": {
                    "all_reduce": float(rng.uniform(0, 0.2)),
                    "ddp_allreduce": float(rng.uniform(0, 0.3)),
                },
                "tau": float(rng.uniform(0.8, 1.2)),
                # two parameter tensors sharded over ranks, and one scanned only as a parameter
                "param": {t: rng.normal(0, 0.05, 40) for t in ("w0", "w1", "lone")},
                "update": {t: rng.normal(0, 1e-4, 40) for t in ("w0", "w1")},
                "experts": {
                    "0": rng.integers(0, 5, 6).astype(float) * (r != 3),
                    "1": np.zeros(6),
                },  # layer 1: no valid token on any rank
                "enc": rng.normal(0, 1e-2, 30),
                "rest": rng.normal(0, 1e-2, 70),
                "mtp": (int(rng.integers(0, 30)), 30),  # (agree, positions)
                "bos": rng.normal(0, 1e-1, (2, 8)),
                "value": rng.normal(0, 1e-2, (9, 8)),
            }
        )
    return ranks


def record(r: int, c: dict) -> RankStep:
    v: dict = {(System.STEP_TIME, ()): c["tau"]}
    every = np.concatenate(list(c["grads"].values()))
    if every.size:
        v.update(_grad_components(every, ()))
    for group, g in c["grads"].items():
        if g.size:
            v.update(_grad_components(g, ((Label.GROUP, group),)))
    for op, w in c["waits"].items():
        v[(Comm.WAIT, ((Label.OP, op),))] = w
    z = c["logits"][c["valid"]]
    top = -np.sort(-z, axis=-1)
    v.update(
        {
            (Output.LOGITS_SUM_SQ, ()): float((z**2).sum()),
            (Output.LOGITS_N, ()): float(z.size),
            (Output.POSITIONS, ()): float(len(z)),
            (Output.TOP2_GAP_SUM, ()): float((top[:, 0] - top[:, 1]).sum()),
            (Output.TOP2_EQUAL, ()): float((top[:, 0] == top[:, 1]).sum()),
        }
    )
    for kind in ("param", "update"):
        for t, x in c[kind].items():
            v[(Tensor.SUM_SQ, ((Label.KIND, kind), (Label.TENSOR, t)))] = float((x**2).sum())
    for layer, counts in c["experts"].items():
        if counts.sum() > 0:  # as the probe: a layer without a valid token sends nothing
            for e, n in enumerate(counts):
                v[(Moe.EXPERT_TOKENS, ((Label.EXPERT, str(e)), (Label.LAYER, layer)))] = float(n)
        v[(Moe.BIAS_ABS_SUM, ((Label.LAYER, layer),))] = 0.5 + int(layer)  # replicated
    v[(Modality.ENCODER_GRAD_SQ, ())] = float((c["enc"] ** 2).sum())
    v[(Modality.ALL_GRAD_SQ, ())] = float((c["enc"] ** 2).sum() + (c["rest"] ** 2).sum())
    agree, positions = c["mtp"]
    v[(Output.MTP_AGREE, ((Label.DEPTH, "1"),))] = float(agree)
    v[(Output.MTP_POSITIONS, ((Label.DEPTH, "1"),))] = float(positions)
    for layer in ("0", "1"):
        lab = ((Label.LAYER, layer),)
        v[(Attn.BOS_SUM_SQ, lab)] = float((c["bos"] ** 2).sum())
        v[(Attn.BOS_N, lab)] = float(c["bos"].size)
        v[(Attn.VALUE_SUM_SQ, lab)] = float((c["value"] ** 2).sum())
        v[(Attn.VALUE_N, lab)] = float(c["value"].size)
    return RankStep(
        run_id="f", step=0, rank=r, world_size=RANKS, host=f"h{r}", coords={"dp": r}, values=v
    )


@pytest.fixture(scope="module")
def ranks_and_step():
    ranks = make_ranks()
    return ranks, reduce_step(
        "f", 0, RANKS, [record(r, c) for r, c in enumerate(ranks)], "all_ranks"
    )


def _g_ref(g: np.ndarray) -> tuple[float, float, float]:
    finite = g[np.isfinite(g)]
    return float(np.abs(finite).mean()), float(np.abs(finite).max()), float((g == 0).mean())


def test_gradient_mean_max_and_zero_fraction_over_all_and_per_group(ranks_and_step):
    ranks, step = ranks_and_step
    out = formed(step)
    pooled = np.concatenate([g for c in ranks for g in c["grads"].values()])
    mean, mx, zero = _g_ref(pooled)
    assert out["grad_abs_mean"] == pytest.approx(mean, rel=REL)
    assert out["grad_abs_max"] == mx
    assert out["grad_zero_frac"] == pytest.approx(zero, rel=REL)
    rows = {row["group"]: row for row in grad_group_rows(step)}
    assert set(rows) == set(GRAD_GROUPS)
    groups = p0_view(step).ranks.group_grad_max  # what the vanishing-gradients rule reads
    assert set(groups) == set(GRAD_GROUPS)
    for group in GRAD_GROUPS:
        g = np.concatenate([c["grads"][group] for c in ranks])
        mean, mx, zero = _g_ref(g)
        assert groups[group] == mx
        assert rows[group]["elements"] == g.size
        assert rows[group]["grad_abs_mean"] == pytest.approx(mean, rel=REL)
        assert rows[group]["grad_abs_max"] == mx
        assert rows[group]["grad_zero_frac"] == pytest.approx(zero, rel=REL)
    assert rows["embedding"]["grad_zero_frac"] > 0.3  # embeddings apart: their sparsity shows


def test_comm_wait_fraction_is_the_largest_rank_wait_over_tau(ranks_and_step):
    ranks, step = ranks_and_step
    waits = np.array([math.fsum(c["waits"].values()) for c in ranks], dtype=np.float64)
    tau = max(c["tau"] for c in ranks)
    assert formed(step)["comm_wait_frac"] == pytest.approx(waits.max() / tau, rel=REL)


def test_update_ratio_over_tensors_scanned_as_both_param_and_update(ranks_and_step):
    ranks, step = ranks_and_step
    w = np.concatenate([c["param"][t] for c in ranks for t in ("w0", "w1")])
    dw = np.concatenate([c["update"][t] for c in ranks for t in ("w0", "w1")])
    rho = np.sqrt(np.mean(dw**2)) / np.sqrt(np.mean(w**2))  # RMS(Δw)/RMS(w), seeds §6
    assert formed(step)["update_ratio"] == pytest.approx(rho, rel=1e-9)


def test_output_logit_series_over_valid_positions(ranks_and_step):
    ranks, step = ranks_and_step
    z = np.concatenate([c["logits"][c["valid"]] for c in ranks])
    top = -np.sort(-z, axis=-1)
    out = formed(step)
    assert out["logits_rms"] == pytest.approx(np.sqrt(np.mean(z**2)), rel=REL)
    assert out["top2_gap_mean"] == pytest.approx(np.mean(top[:, 0] - top[:, 1]), rel=REL)
    assert out["top2_tie_frac"] == pytest.approx(np.mean(top[:, 0] == top[:, 1]), rel=REL)
    assert out["top2_tie_frac"] > 0


def test_dead_expert_ratio_skips_a_layer_without_tokens(ranks_and_step):
    ranks, step = ranks_and_step
    counts = np.sum([c["experts"]["0"] for c in ranks], axis=0)
    assert formed(step)["dead_expert_ratio"] == pytest.approx(np.mean(counts == 0))


def test_encoder_share_mtp_agreement_bos_gradient_and_bias_sum(ranks_and_step):
    ranks, step = ranks_and_step
    out = formed(step)
    enc = np.concatenate([c["enc"] for c in ranks])
    rest = np.concatenate([c["rest"] for c in ranks])
    assert out["encoder_grad_share"] == pytest.approx(
        np.sum(enc**2) / (np.sum(enc**2) + np.sum(rest**2)), rel=REL
    )
    agree, positions = np.sum([c["mtp"] for c in ranks], axis=0)
    assert out["mtp_agreement"] == pytest.approx(agree / positions, rel=REL)
    bos = np.concatenate([c["bos"].ravel() for c in ranks for _ in range(2)])  # two layers
    value = np.concatenate([c["value"].ravel() for c in ranks for _ in range(2)])
    assert out["bos_value_grad_rms"] == pytest.approx(np.sqrt(np.mean(bos**2)), rel=REL)
    assert out["bos_value_grad_ratio"] == pytest.approx(
        np.sqrt(np.mean(bos**2)) / np.sqrt(np.mean(value**2)), rel=REL
    )
    assert out["ep_bias_abs_sum"] == 0.5 + 1.5  # one replica per layer, summed over layers


def test_a_step_without_the_components_measures_nothing():
    """An every-step record (no scan components, no collectives, no owner of a gradient):
    every formed series is None, not zero; the view carries them all."""
    step = reduce_step(
        "f",
        1,
        1,
        [
            RankStep(
                run_id="f",
                step=1,
                rank=0,
                world_size=1,
                host="h",
                coords={},
                values={(System.STEP_TIME, ()): 1.0},
            )
        ],
        "all_ranks",
    )
    out = formed(step)
    assert all(v is None for v in out.values()), out
    assert grad_group_rows(step) == []


def test_the_registry_of_formed_series_is_the_schema_and_the_view():
    """``instrument.series.FORMED`` (README table, the demo's end-to-end check) names exactly
    the columns migration 4 added and ``formed_series`` / ``grad_group_rows`` fill."""
    from probewire.sinks.schema import _STEP_METRICS_V4, GRAD_GROUP_STATS

    step_columns = {s.column for s in FORMED if s.table == "step_metrics"}
    assert step_columns == {c.name for c in _STEP_METRICS_V4 if c.type == "Nullable(Float64)"}
    empty = reduce_step("f", 0, 1, [], "all_ranks")
    assert step_columns == set(formed_series(empty))
    assert step_columns <= set(p0_view(empty).view)
    assert {s.column for s in FORMED if s.table == GRAD_GROUP_STATS.name} == {
        c.name for c in GRAD_GROUP_STATS.columns if c.type == "Nullable(Float64)"
    }
    assert {s.table for s in FORMED} == {"step_metrics", GRAD_GROUP_STATS.name}
