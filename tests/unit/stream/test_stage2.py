"""Stage 2 on synthetic runs: the P0 row, detectors, alerts, retention and restart."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from probewire.instrument.wire import RankStep, series_key
from probewire.stream.records import ReducedStep
from probewire.stream.reduce import reduce_step
from probewire.stream.retention import retained_steps
from probewire.stream.signals import DetectorConfig
from probewire.stream.split import wire_parts
from probewire.stream.stage2 import RunPipeline, Stage2Config, detail_output, p0_view
from probewire.stream.view import rank_table


def with_experts(item, counts: dict[tuple[str, int], float]):
    """Reduced per-expert token counts c_i (catalog entry arrives with the structure probes)."""
    for (layer, expert), c in counts.items():
        item.reduced[series_key("moe.expert_tokens", {"layer": layer, "expert": str(expert)})] = c
    return item


def records(step, per_rank, *, g2=1.0, tau=None, sources=None, memory=None):
    out = []
    for r, (loss_sum, n) in enumerate(per_rank):
        values = {
            series_key("loss.sum"): loss_sum,
            series_key("loss.tokens"): n,
            series_key("step.duration"): (tau or [0.1] * len(per_rank))[r],
            series_key("flops.step"): 1e9,
        }
        if r == 0:  # the all-reduced gradient: reported by its owner, dp=0
            values[series_key("grad.norm_sq")] = g2
        for src, (s, c) in (sources or {}).get(r, {}).items():
            values[series_key("loss.sum", {"source": src})] = s
            values[series_key("loss.tokens", {"source": src})] = c
        if memory:
            values[series_key("memory.peak_rss")] = memory[r]
        out.append(
            RankStep(
                run_id="run",
                step=step,
                rank=r,
                world_size=len(per_rank),
                host="h",
                coords={"dp": r},
                values=values,
            )
        )
    return reduce_step("run", step, len(per_rank), out, "all_ranks")


def small_config(**kw) -> Stage2Config:
    det = DetectorConfig(window=20, rearm_steps=10, **kw)
    return Stage2Config(
        detectors=det,
        retention_every_k=10,
        retention_halo=5,
        warmup_steps=3,
        final_steps=4,
        max_wait_s=5,
        run_idle_s=30,
    )


def test_p0_view_matches_numpy_reference():
    item = records(
        0,
        [(30.0, 10.0), (8.0, 2.0), (0.0, 0.0)],
        g2=9.0,
        tau=[0.1, 0.4, 0.2],
        sources={0: {"docs": (20.0, 8.0), "code": (10.0, 2.0)}, 1: {"docs": (8.0, 2.0)}},
        memory=[100.0, 300.0, 200.0],
    )
    with_experts(item, {("0", 0): 7.0, ("0", 1): 5.0})
    view, sources, _ = p0_view(item)
    assert view["loss"] == pytest.approx(38.0 / 12.0)
    assert view["loss_worst_rank"] == pytest.approx(4.0) and view["loss_worst_rank_id"] == 1
    assert view["grad_norm"] == pytest.approx(3.0)
    assert view["step_time_s"] == 0.4 and view["straggler_rank"] == 1
    assert view["straggler_score"] == pytest.approx(0.4 / float(np.median([0.1, 0.4, 0.2])))
    # no rank reported a collective wait: own time = step time, against the others' median
    assert view["straggler_own_ratio"] == pytest.approx(0.4 / float(np.median([0.1, 0.2])))
    assert view["tokens_per_s"] == pytest.approx(12 / 0.4)
    assert view["compute_rate"] == pytest.approx(3e9 / (3 * 0.4))
    assert view["peak_memory_bytes"] == 300.0 and view["peak_memory_rank"] == 1
    counts = np.array([7.0, 5.0])
    assert view["moe_maxvio"] == pytest.approx(counts.max() / counts.mean() - 1)
    p = counts / counts.sum()
    assert view["moe_h_norm"] == pytest.approx(float(-(p * np.log(p)).sum() / np.log(2)))
    assert sources["docs"] == pytest.approx((28.0 / 10.0, 10.0 / 12.0, 10.0))
    assert sources["code"] == pytest.approx((10.0 / 2.0, 2.0 / 12.0, 2.0))


def test_empty_expert_layer_records_nothing():
    item = with_experts(records(0, [(1.0, 1.0)]), {("0", 0): 0.0, ("0", 1): 0.0})
    view, _, _ = p0_view(item)
    assert view["moe_maxvio"] is None and view["moe_h_norm"] is None


def run_series(losses, grads, config=None, start=0):
    run = RunPipeline("run", config or small_config())
    outs = []
    for i, (loss, g) in enumerate(zip(losses, grads)):
        outs.append(run.accept(records(start + i, [(loss * 10, 10.0)], g2=g * g), now=i))
    return run, outs


def test_cospike_pages_once_at_the_injected_step_with_cumulative_count():
    rng = np.random.default_rng(1)
    losses = list(3.0 * np.exp(rng.normal(0, 0.01, 60)))
    grads = list(0.5 * np.exp(rng.normal(0, 0.05, 60)))
    losses[40] *= 3.0
    grads[40] *= 20.0
    run, outs = run_series(losses, grads)
    alerts = [a for o in outs for a in o.rows["alerts"]]
    assert [(a["step"], a["signal"]) for a in alerts] == [(40, "cospike")]
    assert alerts[0]["next_steps"][0].startswith("gradient norm")
    rows = [r for o in outs for r in o.rows["step_metrics"]]
    assert [r["cospike_count"] for r in rows][39:42] == [0, 1, 1]
    assert rows[40]["cospike"] == 1 and rows[40]["cospike_magnitude"] > 6


def test_loss_spike_alone_is_an_anomaly_not_a_page():
    rng = np.random.default_rng(2)
    losses = list(3.0 * np.exp(rng.normal(0, 0.01, 40)))
    losses[30] *= 3.0
    run, outs = run_series(losses, [0.5] * 40)
    assert not [a for o in outs for a in o.rows["alerts"]]
    anomalies = [(a["step"], a["signal"]) for o in outs for a in o.rows["anomalies"]]
    assert anomalies == [(30, "loss")]


def test_nonfinite_loss_pages_even_during_warmup():
    run, outs = run_series([3.0, math.nan, 3.0], [0.5, 0.5, 0.5])
    (alert,) = [a for o in outs for a in o.rows["alerts"]]
    assert alert["step"] == 1 and alert["signal"] == "loss"
    assert math.isnan(outs[1].rows["step_metrics"][0]["loss"])


def test_retained_steps_equal_the_closed_form_policy():
    rng = np.random.default_rng(3)
    n = 80
    losses = list(3.0 * np.exp(rng.normal(0, 0.01, n)))
    grads = list(0.5 * np.exp(rng.normal(0, 0.05, n)))
    for s in (25, 61):
        losses[s] *= 3
        grads[s] *= 20
    run, outs = run_series(losses, grads)
    promoted = [s for o in outs for s in o.promote] + run.finish().promote
    anomaly_steps = {a["step"] for o in outs for a in o.rows["anomalies"]}
    assert anomaly_steps == {25, 61}
    assert sorted(promoted) == sorted(
        retained_steps(n, anomaly_steps, k=10, halo=5, warmup_steps=3, final_steps=4)
    )
    assert len(promoted) == len(set(promoted))


def test_restart_from_state_gives_the_same_rows_as_an_uninterrupted_run():
    rng = np.random.default_rng(4)
    losses = list(3.0 * np.exp(rng.normal(0, 0.01, 70)))
    grads = list(0.5 * np.exp(rng.normal(0, 0.05, 70)))
    losses[50] *= 3
    grads[50] *= 20
    _, straight = run_series(losses, grads)
    config = small_config()
    first = RunPipeline("run", config)
    outs = [
        first.accept(records(i, [(losses[i] * 10, 10.0)], g2=grads[i] ** 2), now=i)
        for i in range(35)
    ]
    state = json.loads(json.dumps(first.to_state()))  # what ClickHouse holds
    second = RunPipeline.from_state("run", config, state, now=35)
    # re-delivery of already-processed steps after the restart changes nothing
    replay = [
        second.accept(records(i, [(losses[i] * 10, 10.0)], g2=grads[i] ** 2), now=35)
        for i in range(30, 35)
    ]
    assert all(not o.rows["step_metrics"] and not o.promote for o in replay)
    outs += [
        second.accept(records(i, [(losses[i] * 10, 10.0)], g2=grads[i] ** 2), now=i)
        for i in range(35, 70)
    ]

    def strip(rows):
        return [{k: v for k, v in r.items()} for r in rows]

    for table in ("step_metrics", "anomalies", "alerts"):
        a = strip([r for o in straight for r in o.rows[table]])
        b = strip([r for o in outs for r in o.rows[table]])
        assert json.dumps(a, default=str) == json.dumps(b, default=str), table
    assert [s for o in straight for s in o.promote] == [s for o in outs for s in o.promote]


def test_worst_rank_and_source_regression_name_their_culprits():
    config = small_config()
    run = RunPipeline("run", config)
    rng = np.random.default_rng(5)
    found = []
    for step in range(40):
        bad = step >= 30
        noise = rng.normal(0, 0.01, 3)
        per_rank = [
            (3.0 * (1 + noise[r]) * 10 * (4.0 if bad and r == 2 else 1.0), 10.0) for r in range(3)
        ]
        src = {0: {"docs": (2.0 * 5, 5.0), "rare": ((9.0 if bad else 4.0) * (1 + noise[0]), 1.0)}}
        out = run.accept(records(step, per_rank, sources=src), now=step)
        found += out.rows["alerts"]
    culprits = {(a["step"], a["signal"], a["message"].split("carried by ")[-1]) for a in found}
    assert (30, "loss_worst_rank", "rank 2") in culprits
    assert (30, "loss_by_source", "source rare") in culprits


def test_a_step_after_an_idle_expiry_reopens_the_run_and_is_stored():
    run = RunPipeline("run", small_config())
    for step in range(10):
        run.accept(records(step, [(30.0, 10.0)]), now=step)
    first = run.expire(now=100.0)  # idle past run_idle_s: finished, final steps released
    assert run.finished and [r["status"] for r in first.rows["runs"]] == ["finished"]
    assert run.expire(now=200.0).rows == {} and run.finish().rows == {}  # idempotent
    out = run.accept(records(10, [(30.0, 10.0)]), now=300.0)
    assert [r["step"] for r in out.rows["step_metrics"]] == [10] and not run.finished
    assert [r["status"] for r in out.rows["runs"]] == ["running"]
    run.accept(records(11, [(30.0, 10.0)]), now=301.0)
    again = run.expire(now=400.0)
    assert [r["status"] for r in again.rows["runs"]] == ["finished"]
    assert again.promote == [11]  # the final steps of the segment after the pause


def test_a_step_after_its_gap_was_skipped_is_stored_flagged_and_kept():
    run = RunPipeline("run", small_config())
    for step in [*range(10), *range(11, 30)]:
        run.accept(records(step, [(30.0, 10.0)]), now=0.0)
    run.expire(now=10.0)  # step 10 never came: the gap is skipped after max_wait_s
    assert run.last_step == 29
    detectors = json.dumps(run.detectors.to_state())
    out = run.accept(records(10, [(33.0, 10.0)]), now=11.0)
    (row,) = out.rows["step_metrics"]
    assert row["step"] == 10 and row["complete_reason"] == "after_gap"
    assert row["loss"] == pytest.approx(3.3) and row["loss_z"] is not None  # scored
    assert out.promote == [10]  # after-gap detail is retained
    assert json.dumps(run.detectors.to_state()) == detectors  # detectors not fed
    assert run.accept(records(10, [(33.0, 10.0)]), now=12.0).rows.get("step_metrics") is None


def test_a_huge_step_jump_allocates_nothing_proportional_to_it():
    run = RunPipeline("run", small_config())
    run.accept(records(0, [(30.0, 10.0)]), now=0.0)
    run.accept(records(2**62, [(30.0, 10.0)]), now=0.0)
    run.expire(now=10.0)
    assert run.last_step == 2**62 and len(run.skipped) == 1
    assert 2**61 in run.skipped
    state = json.loads(json.dumps(run.to_state()))
    assert RunPipeline.from_state("run", small_config(), state, now=0.0).skipped.to_state() == [
        [1, 2**62 - 1]
    ]


def test_guard_counters_are_cumulative_across_a_restart_with_the_step_flags_kept():
    """Seeds 001 §4: skip and replay counters stored cumulative (the catalog and the schema
    say so), each step's own events kept beside them; the counts survive a restart."""
    events = {
        3: ("guard.skipped",),
        5: ("guard.replayed", "guard.replay_mismatch"),
        8: ("guard.skipped", "guard.replayed"),
    }

    def step_item(step):
        item = records(step, [(10.0, 5.0), (11.0, 5.0)])
        for name in events.get(step, ()):
            item.reduced[series_key(name)] = 1.0
        return item

    run = RunPipeline("run", small_config())
    rows, anomalies = [], []
    for step in range(10):
        if step == 6:
            run = RunPipeline.from_state(
                "run", small_config(), json.loads(json.dumps(run.to_state())), now=6.0
            )
        out = run.accept(step_item(step), now=float(step))
        rows += out.rows["step_metrics"]
        anomalies += out.rows["anomalies"]
    # the mismatch pages at its own step only, not on every step after it
    assert [a["step"] for a in anomalies if a["signal"] == "replay_mismatch"] == [5]
    by_step = {row["step"]: row for row in rows}
    flags = {
        "skipped": "guard.skipped",
        "replayed": "guard.replayed",
        "replay_mismatch": "guard.replay_mismatch",
    }
    for column, name in flags.items():
        per_step = [int(name in events.get(s, ())) for s in range(10)]
        assert [by_step[s][f"{column}_step"] for s in range(10)] == per_step
        assert [by_step[s][column] for s in range(10)] == list(np.cumsum(per_step))


def test_a_step_whose_components_break_the_rules_is_refused_before_any_state_moves():
    """A loss sum on a rank with no token (stage 1's bounds refuse it; another writer of
    the steps topic might not) is refused with the reason; the run goes on unchanged but
    for the orderer, which has handed the step over (and now waits for the next)."""

    def state(run: RunPipeline) -> str:
        return json.dumps(
            {k: v for k, v in run.to_state().items() if k != "orderer"}, sort_keys=True, default=str
        )

    run = RunPipeline("run", small_config())
    run.accept(records(0, [(3.0, 1.0), (2.0, 1.0)]), 0.0)
    before = state(run)
    out = run.accept(records(1, [(3.0, 1.0), (2.0, 0.0)]), 0.1)
    [(step, reason)] = out.refused
    assert step == 1 and "refused by stage 2" in reason and "token_counts" in reason
    assert not out.rows.get("step_metrics") and run.last_step == 0
    assert state(run) == before
    out = run.accept(records(2, [(3.0, 1.0), (2.0, 1.0)]), 0.2)
    assert [r["step"] for r in out.rows["step_metrics"]] == [2] and run.last_step == 2


def test_a_replay_stores_the_detail_of_a_past_step_apart_and_promotes_it():
    run = RunPipeline("run", small_config())
    outs = [run.accept(records(s, [(2.0, 1.0), (2.0, 1.0)]), now=float(s)) for s in range(6)]
    stored = [r for o in outs for r in o.rows["step_metrics"]]
    labels = {"tensor": "blocks.0", "kind": "fwd"}
    values = {
        "n": 16.0,
        "sum": 4.0,
        "sum_sq": 8.0,
        "abs_sum": 6.0,
        "abs_max": 5.0,
        "zeros": 1.0,
        "nonfinite": 0.0,
    }
    replay = [
        RankStep(
            run_id="run",
            step=4,
            rank=r,
            world_size=2,
            host="h",
            coords={"dp": r},
            replay=True,
            values={series_key(f"tensor.{k}", labels): v / 2 for k, v in values.items()},
        )
        for r in range(2)
    ]
    item = reduce_step("run", 4, 2, replay, "replay")
    ((detail, data),) = wire_parts(item, 1_000_000)  # the detail topic, never stage 2's path
    assert detail and run.detail_kept(item)  # promoted once written
    out = detail_output(*ReducedStep.detail_from_bytes(data))
    assert not out.rows["step_metrics"] and not out.rows["anomalies"]
    (row,) = out.rows["tensor_stats_recent"]
    assert row["step"] == 4 and (row["tensor"], row["kind"]) == ("blocks.0", "fwd")
    assert row["abs_max"] == 2.5 and row["n"] == 16.0 and row["sum"] == 4.0
    assert set(rank_table(out.columns["rank_metrics_recent"])["late"].to_pylist()) == {1}
    recent = (list(out.rows["tensor_stats_recent"]), out.columns["rank_metrics_recent"])
    out.retain_detail()  # kept already: the same rows into the detail tables, in one write
    assert out.rows["tensor_stats"] == out.rows["tensor_stats_recent"] == recent[0]
    assert out.columns["rank_metrics"] == out.columns["rank_metrics_recent"] == recent[1]
    assert "step_metrics" not in out.columns and not out.rows["step_metrics"]
    # the run's own rows did not move: a later step continues the counters
    nxt = run.accept(records(6, [(2.0, 1.0), (2.0, 1.0)]), now=8.0).rows["step_metrics"]
    assert nxt[0]["tokens"] == stored[-1]["tokens"] + 2


def with_tensors(item, names: list[str]):
    """Reduced one-pass scans of ``names`` (kind fwd) added to a reduced step."""
    for name in names:
        labels = {"tensor": name, "kind": "fwd"}
        for field, v in {
            "n": 4.0,
            "sum": 1.0,
            "sum_sq": 2.0,
            "abs_sum": 2.0,
            "abs_max": 1.0,
            "zeros": 0.0,
            "nonfinite": 0.0,
        }.items():
            item.reduced[series_key(f"tensor.{field}", labels)] = v
    return item


def test_each_tensor_label_gets_one_tensor_names_row_per_run_across_a_restart():
    names = ["embed", "blocks.0", "blocks.0.moe.experts.1.w1.weight", "blocks.1.attn.qkv.q"]
    run = RunPipeline("run", small_config())
    first = run.accept(with_tensors(records(0, [(2.0, 1.0)]), names[:3]), now=0.0)
    assert first.rows["tensor_names"] == [
        {
            "run_id": "run",
            "tensor": "embed",
            "layer": None,
            "role": "embed",
            "expert": None,
            "first_step": 0,
        },
        {
            "run_id": "run",
            "tensor": "blocks.0",
            "layer": 0,
            "role": "block",
            "expert": None,
            "first_step": 0,
        },
        {
            "run_id": "run",
            "tensor": "blocks.0.moe.experts.1.w1.weight",
            "layer": 0,
            "role": "moe.experts.w1.weight",
            "expert": 1,
            "first_step": 0,
        },
    ]
    again = run.accept(with_tensors(records(1, [(2.0, 1.0)]), names[:3]), now=1.0)
    assert not again.rows.get("tensor_names") and again.rows["tensor_stats_recent"]
    restored = RunPipeline.from_state(
        "run", small_config(), json.loads(json.dumps(run.to_state())), now=2.0
    )
    out = restored.accept(with_tensors(records(2, [(2.0, 1.0)]), names), now=2.0)
    assert [
        (r["tensor"], r["layer"], r["role"], r["first_step"]) for r in out.rows["tensor_names"]
    ] == [("blocks.1.attn.qkv.q", 1, "attn.qkv.q", 2)]


def test_ranks_clipping_at_different_thresholds_are_a_dead_letter_once_per_disagreement():
    """Every rank sends c (grad.clip_threshold) with grad.clipped = 1[G2 > c]: where the
    ranks' c differ the step is stored (clipped: 1 where any rank clipped) and a dead letter
    names each c with its ranks; said once while the disagreement lasts, again when it
    changes or comes back after the ranks agreed."""
    g2 = 0.49  # G2 = 0.7: clipped at c = 0.5, not at c = 1.0

    def step(n: int, thresholds: list[float]):
        item = records(n, [(3.0, 1.0)] * len(thresholds), g2=g2)
        for rank, c in enumerate(thresholds):
            item.per_rank[rank][series_key("grad.clip_threshold")] = c
            item.per_rank[rank][series_key("grad.clipped")] = float(math.sqrt(g2) > c)
        item.reduced[series_key("grad.clip_threshold")] = max(thresholds)
        item.reduced[series_key("grad.clipped")] = float(math.sqrt(g2) > min(thresholds))
        return item

    run = RunPipeline("run", small_config())
    plan = {  # step -> each rank's c
        0: [0.5, 0.5, 0.5],
        1: [0.5, 1.0, 0.5],
        2: [0.5, 1.0, 0.5],
        3: [0.5, 1.0, 1.0],
        4: [0.5, 0.5, 0.5],
        5: [0.5, 1.0, 0.5],
    }
    outs = {n: run.accept(step(n, cs), float(n)) for n, cs in plan.items()}
    letters = {n: out.dead_letters for n, out in outs.items()}
    assert {n: [s for s, _ in ls] for n, ls in letters.items()} == {
        0: [],
        1: [1],
        2: [],
        3: [3],
        4: [],
        5: [5],
    }
    assert (
        "grad.clip_threshold differs between ranks (c=0.5 on ranks [0, 2]; c=1 on ranks [1])"
        in letters[1][0][1]
    )
    assert "c=0.5 on ranks [0]; c=1 on ranks [1, 2]" in letters[3][0][1]
    assert "step 1 of run 'run'" in letters[1][0][1]
    stored = {r["step"]: r["clipped"] for out in outs.values() for r in out.rows["step_metrics"]}
    assert stored == dict.fromkeys(range(6), 1)  # rank 0 clipped at 0.5 every step
    assert all(not out.refused for out in outs.values())
