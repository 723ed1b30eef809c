"""The registry of stored series (``stream.series``): the table, the view and the charts are
its rows; and the series added through it alone, MaxVio averaged over MoE layers
(``moe_maxvio_mean``), against a float64 NumPy reference and on a migrated store."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from probewire.instrument.catalog import Label, Memory, Moe
from probewire.instrument.wire import RankStep
from probewire.sinks import TABLES, ClickHouseSink
from probewire.sinks.schema import MIGRATIONS, STEP_METRICS
from probewire.stream.reduce import reduce_step
from probewire.stream.series import CHARTS, STEP_SERIES, VIEW, Kind, StepMetrics, chart_columns
from probewire.stream.view import p0_view


def test_every_step_metrics_column_is_a_registry_row_in_table_order():
    assert [c.name for c in STEP_METRICS.columns] == [*map(str, STEP_SERIES), "inserted_at"]
    assert [c.type for c in STEP_METRICS.columns[:-1]] == [s.sql for s in STEP_SERIES]


def test_the_view_forms_exactly_the_rows_with_a_formula():
    """Stage 2's view is the rows with formulas (plus the two values it reads unstored);
    the others are the key, stage 2's totals and the detectors' outputs."""
    empty = reduce_step("r", 0, 1, [], "all_ranks")
    view = p0_view(empty).view
    assert set(view) - {"flops_step", "moe_maxvio_layer"} == set(map(str, VIEW))
    unformed = {s.kind for s in STEP_SERIES if s.formula is None}
    assert unformed == {Kind.KEY, Kind.TOTAL, Kind.DETECTOR}


def test_a_typo_in_a_rule_fails_at_attribute_lookup():
    with pytest.raises(AttributeError):
        StepMetrics.grad_nrom  # noqa: B018


def test_every_chart_draws_registry_columns_and_every_charted_row_has_a_chart():
    keys = {c.key for c in CHARTS}
    assert all(s.chart in keys for s in STEP_SERIES if s.chart is not None)
    drawn = {column for c in CHARTS for column, _ in chart_columns(c)}
    assert drawn == {s.name for s in STEP_SERIES if s.chart is not None}


def _moe_ranks(loads: dict[str, np.ndarray]) -> list[RankStep]:
    """Two ranks splitting each layer's per-expert loads; a layer with no token sends
    nothing (as the probe)."""
    ranks = []
    for r in range(2):
        values = {}
        for layer, counts in loads.items():
            part = counts // 2 if r == 0 else counts - counts // 2
            if part.sum() > 0:
                for e, n in enumerate(part):
                    key = ((Label.EXPERT, str(e)), (Label.LAYER, layer))
                    values[(Moe.EXPERT_TOKENS, key)] = float(n)
        ranks.append(
            RankStep(
                run_id="m", step=0, rank=r, world_size=2, host="h", coords={"dp": r}, values=values
            )
        )
    return ranks


def test_maxvio_mean_over_layers_equals_the_reference_and_skips_empty_layers():
    rng = np.random.default_rng(7)
    loads = {str(i): rng.integers(0, 400, size=8).astype(np.int64) for i in range(5)}
    loads["2"][:] = 0  # no valid token reached layer 2: not a balanced layer
    loads["4"][3] = 5_000  # one hot expert
    step = reduce_step("m", 0, 2, _moe_ranks(loads), "all_ranks")
    view = p0_view(step).view
    per_layer = [
        np.max(c.astype(np.float64)) / np.mean(c.astype(np.float64)) - 1.0
        for c in loads.values()
        if c.sum() > 0
    ]
    assert len(per_layer) == 4
    assert view[StepMetrics.moe_maxvio_mean] == pytest.approx(np.mean(per_layer), rel=1e-12)
    assert view[StepMetrics.moe_maxvio] == pytest.approx(np.max(per_layer), rel=1e-12)
    assert p0_view(reduce_step("m", 1, 1, [], "all_ranks")).view["moe_maxvio_mean"] is None


def test_a_version_6_store_gets_the_registry_column_of_migration_7(ch_client, ch_database):
    """A store migrated to version 6 (no moe_maxvio_mean) is upgraded by the migration the
    registry row makes: the column lands after moe_maxvio, the rows are kept."""
    db = ch_database + "_v6"
    table = next(t for t in TABLES if t.name == "step_metrics")
    old = dataclasses.replace(
        table, columns=tuple(c for c in table.columns if c.name != "moe_maxvio_mean")
    )
    ch_client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
    sink = ClickHouseSink(ch_client, db)
    ch_client.command(
        f"CREATE TABLE {db}.schema_migrations (version UInt32, description String, "
        "applied_at DateTime64(3) DEFAULT now64(3)) ENGINE = ReplacingMergeTree ORDER BY version"
    )
    for t in TABLES:
        ch_client.command((old if t is table else t).ddl(db))
    ch_client.command(
        f"INSERT INTO {db}.schema_migrations (version, description) "
        "VALUES (1, ''), (2, ''), (3, ''), (4, ''), (5, ''), (6, '')"
    )
    ch_client.command(f"INSERT INTO {db}.step_metrics (run_id, step, tokens) VALUES ('r', 3, 9)")
    assert sink.migrate() == MIGRATIONS[-1].version
    names = [
        r[0]
        for r in ch_client.query(
            f"SELECT name FROM system.columns WHERE database = '{db}' "
            "AND table = 'step_metrics' ORDER BY position"
        ).result_rows
    ]
    assert names == [c.name for c in table.columns]
    assert names.index("moe_maxvio_mean") == names.index("moe_maxvio") + 1
    assert ch_client.query(
        f"SELECT step, tokens, moe_maxvio_mean FROM {db}.step_metrics"
    ).result_rows == [(3, 9, None)]


def test_residual_stats_hold_every_branchs_token_means_and_stage_2_writes_them():
    """R_b, N_s, N_b of each (layer, branch) as Σ over ranks / Σ tokens (the depth profile
    the report draws); the weakest branch stays in step_metrics."""
    from probewire.instrument.catalog import Residual
    from probewire.stream.stage2 import RunPipeline, Stage2Config

    rng = np.random.default_rng(3)
    sums = {"ratio": {}, "stream_norm": {}, "branch_norm": {}}
    ranks = []
    for r in range(2):
        values = {}
        for layer in ("0", "1", "2"):
            for branch in ("attn", "mlp"):
                labels = ((Label.BRANCH, branch), (Label.LAYER, layer))
                n = float(rng.integers(5, 40))
                values[(Residual.TOKENS, labels)] = n
                sums.setdefault("tokens", {}).setdefault(labels, []).append(n)
                for stat in ("ratio", "stream_norm", "branch_norm"):
                    v = float(rng.uniform(0.1, 2.0)) * n
                    values[(Residual.name(stat, "sum"), labels)] = v
                    sums[stat].setdefault(labels, []).append(v)
        ranks.append(
            RankStep(run_id="rs", step=0, rank=r, world_size=2, host="h", coords={"dp": r},
                     values=values)
        )  # fmt: skip
    step = reduce_step("rs", 0, 2, ranks, "all_ranks")
    rows = RunPipeline("rs", Stage2Config()).accept(step, 0.0).rows["residual_stats"]
    assert len(rows) == 6
    for row in rows:
        labels = ((Label.BRANCH, row["branch"]), (Label.LAYER, row["layer"]))
        tokens = np.sum(sums["tokens"][labels], dtype=np.float64)
        assert row["tokens"] == tokens
        for stat in ("ratio", "stream_norm", "branch_norm"):
            assert row[stat] == pytest.approx(np.sum(sums[stat][labels]) / tokens, rel=1e-12)
    view = p0_view(step).view
    assert view[StepMetrics.residual_ratio_min] == min(r["ratio"] for r in rows)


def test_modality_token_share_is_each_modalitys_tokens_over_all_and_absent_without_media():
    """π^(μ) = Σ_r tokens{μ} / Σ_μ Σ_r tokens (seeds 001 §9), a rank without media sending
    no media count; a step without a media path stores an empty map, not a zero share."""
    from probewire.instrument.catalog import Modality

    counts = {
        0: {"text": 300.0, "media": 64.0},
        1: {"text": 250.0},
        2: {"text": 10.0, "media": 1.0},
    }
    ranks = [
        RankStep(run_id="pi", step=0, rank=r, world_size=3, host="h", coords={"dp": r},
                 values={(Modality.TOKENS, ((Label.MODALITY, m),)): n for m, n in c.items()})
        for r, c in counts.items()
    ]  # fmt: skip
    view = p0_view(reduce_step("pi", 0, 3, ranks, "all_ranks")).view
    text = np.sum([c.get("text", 0.0) for c in counts.values()], dtype=np.float64)
    media = np.sum([c.get("media", 0.0) for c in counts.values()], dtype=np.float64)
    assert view[StepMetrics.modality_token_share] == pytest.approx(
        {"media": media / (text + media), "text": text / (text + media)}, rel=1e-15
    )
    assert p0_view(reduce_step("pi", 1, 1, [], "all_ranks")).view["modality_token_share"] == {}


def test_mtp_agreement_per_depth_beside_the_pooled_value():
    """002 act/mtp_{k}_lm_head_top1_agreement is one value per depth k: Σ agree{k} / Σ
    positions{k} over ranks; the pooled column stays Σ_k agree / Σ_k positions."""
    from probewire.instrument.catalog import Output

    agree = {0: {"1": 40.0, "2": 22.0}, 1: {"1": 35.0, "2": 15.0}}
    positions = {0: {"1": 60.0, "2": 60.0}, 1: {"1": 50.0, "2": 50.0}}
    ranks = []
    for r in (0, 1):
        values = {}
        for k in ("1", "2"):
            values[(Output.MTP_AGREE, ((Label.DEPTH, k),))] = agree[r][k]
            values[(Output.MTP_POSITIONS, ((Label.DEPTH, k),))] = positions[r][k]
        ranks.append(RankStep(run_id="mtp", step=0, rank=r, world_size=2, host="h",
                              coords={"dp": r}, values=values))  # fmt: skip
    view = p0_view(reduce_step("mtp", 0, 2, ranks, "all_ranks")).view
    per = {k: (agree[0][k] + agree[1][k]) / (positions[0][k] + positions[1][k]) for k in ("1", "2")}
    assert view[StepMetrics.mtp_agreement_by_depth] == pytest.approx(per, rel=1e-15)
    assert per["1"] > 0.6 > per["2"]  # the depths differ: pooling hides the deeper head
    pooled = sum(sum(a.values()) for a in agree.values()) / sum(
        sum(p.values()) for p in positions.values()
    )
    assert view[StepMetrics.mtp_agreement] == pytest.approx(pooled, rel=1e-15)


def _memory_ranks(peaks: dict[int, float], capacities: dict[int, float], peak: str) -> list:
    """Ranks sending their step peak (``peak``: memory.peak_allocated, on CPU peak_rss) and,
    where given, their memory.capacity."""
    return [
        RankStep(
            run_id="mem",
            step=0,
            rank=r,
            world_size=len(peaks),
            host="h",
            coords={"dp": r},
            values={
                (peak, ()): p,
                **({(Memory.CAPACITY, ()): capacities[r]} if r in capacities else {}),
            },
        )
        for r, p in peaks.items()
    ]


@pytest.mark.parametrize("peak", [Memory.PEAK_ALLOCATED, Memory.PEAK_RSS])
def test_memory_headroom_is_the_worst_ranks_and_capacity_the_smallest(peak):
    """Four ranks, unequal devices (80 and 40 GiB), one rank without a capacity: the stored
    capacity is the smallest sent, the headroom min_r 1 - peak_r / capacity_r over the ranks
    that sent both, against float64 NumPy; the worst rank is not the one with the peak. No
    capacity sent: both None."""
    gib = float(1 << 30)
    peaks = {0: 60 * gib, 1: 36 * gib, 2: 20 * gib, 3: 79.5 * gib}
    capacities = {0: 80 * gib, 1: 40 * gib, 2: 40 * gib}  # rank 3 (the peak) sends none
    view = p0_view(reduce_step("mem", 0, 4, _memory_ranks(peaks, capacities, peak), "all_ranks"))
    ranks = sorted(capacities)
    p = np.array([peaks[r] for r in ranks], dtype=np.float64)
    c = np.array([capacities[r] for r in ranks], dtype=np.float64)
    assert view.view[StepMetrics.memory_headroom] == pytest.approx(np.min(1.0 - p / c), rel=1e-12)
    assert np.argmin(1.0 - p / c) == 1  # rank 1: 36 of 40 GiB, tighter than 60 of 80
    assert view.view[StepMetrics.memory_capacity_bytes] == np.min(c)
    bare = p0_view(reduce_step("mem", 1, 4, _memory_ranks(peaks, {}, peak), "all_ranks")).view
    assert bare[StepMetrics.memory_headroom] is None
    assert bare[StepMetrics.memory_capacity_bytes] is None


def test_a_version_7_store_gets_the_memory_columns_of_migration_8(ch_client, ch_database):
    """A store at version 7 (no memory_capacity_bytes, memory_headroom, nor the later
    migrations' columns) is upgraded by the migrations the registry rows make: they land at
    the end of step_metrics, rows kept."""
    db = ch_database + "_v7"
    table = next(t for t in TABLES if t.name == "step_metrics")
    new = {s.name for s in STEP_SERIES if s.since >= 8}
    assert {"memory_capacity_bytes", "memory_headroom"} <= new
    old = dataclasses.replace(table, columns=tuple(c for c in table.columns if c.name not in new))
    ch_client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
    ch_client.command(
        f"CREATE TABLE {db}.schema_migrations (version UInt32, description String, "
        "applied_at DateTime64(3) DEFAULT now64(3)) ENGINE = ReplacingMergeTree ORDER BY version"
    )
    for t in TABLES:
        ch_client.command((old if t is table else t).ddl(db))
    ch_client.command(
        f"INSERT INTO {db}.schema_migrations (version, description) VALUES "
        + ", ".join(f"({v}, '')" for v in range(1, 8))
    )
    ch_client.command(f"INSERT INTO {db}.step_metrics (run_id, step, tokens) VALUES ('r', 3, 9)")
    assert ClickHouseSink(ch_client, db).migrate() == max(m.version for m in MIGRATIONS)
    names = [
        r[0]
        for r in ch_client.query(
            f"SELECT name FROM system.columns WHERE database = '{db}' "
            "AND table = 'step_metrics' ORDER BY position"
        ).result_rows
    ]
    assert names == [c.name for c in table.columns]
    assert names[-6:] == [
        "memory_capacity_bytes",
        "memory_headroom",
        "grad_clip_norm",
        "net_rx_bytes",
        "net_tx_bytes",
        "inserted_at",
    ]
    assert ch_client.query(
        f"SELECT step, tokens, memory_capacity_bytes, memory_headroom FROM {db}.step_metrics"
    ).result_rows == [(3, 9, None, None)]


def _ep_ranks(counts: np.ndarray, shards: list[int] | None) -> list[RankStep]:
    """Two expert-parallel ranks (ep 0 and 1) splitting one layer's loads; every expert
    labelled with its shard when ``shards`` is given (as the probe sends it)."""
    ranks = []
    for r in range(2):
        part = counts // 2 if r == 0 else counts - counts // 2
        values = {}
        for e, n in enumerate(part):
            pairs = [(Label.EXPERT, str(e)), (Label.LAYER, "1")]
            if shards is not None:
                pairs.append((Label.SHARD, str(shards[e])))
            values[(Moe.EXPERT_TOKENS, tuple(sorted(pairs)))] = float(n)
        ranks.append(
            RankStep(
                run_id="ep", step=0, rank=r, world_size=2, host="h", coords={"ep": r}, values=values
            )
        )
    return ranks


def test_shard_imbalance_reads_the_placement_the_ranks_labelled():
    """moe_shard_imbalance = max_s C_s / mean_s C_s over the shards the labels name: strided
    labels give the strided value (float64 NumPy), unlabelled loads the contiguous one, and
    labels that do not name shards 0..S-1 give no value instead of an error."""
    counts = np.array([20, 12, 10, 24, 7, 30, 2, 15], dtype=np.int64)
    strided = [i % 2 for i in range(8)]

    def want(owners):
        loads = np.bincount(owners, weights=counts.astype(np.float64))
        return loads.max() / loads.mean()

    def stored(shards):
        step = reduce_step("ep", 0, 2, _ep_ranks(counts, shards), "all_ranks")
        return p0_view(step).view[StepMetrics.moe_shard_imbalance]

    assert want(strided) != pytest.approx(want([i // 4 for i in range(8)]))
    assert stored(strided) == pytest.approx(want(strided), rel=1e-12)
    assert stored(None) == pytest.approx(want([i // 4 for i in range(8)]), rel=1e-12)
    assert stored([0, 2] * 4) is None


def test_network_bytes_are_summed_over_the_nodes_that_read_them():
    """net.rx / net.tx come from each node's local rank 0 (ranks 0 and 4 of two 4-rank
    nodes): the step's columns are their float64 sums; no rank sending them gives NULL."""
    from probewire.instrument.catalog import Net

    sent = {0: (1.5e9, 2.25e8), 4: (7.0e8 + 3.0, 1.0e9)}  # rank: (rx, tx)
    ranks = [
        RankStep(
            run_id="net",
            step=0,
            rank=r,
            world_size=8,
            host=f"node{r // 4}",
            coords={"dp": r},
            values={(Net.RX, ()): sent[r][0], (Net.TX, ()): sent[r][1]} if r in sent else {},
        )
        for r in range(8)
    ]
    view = p0_view(reduce_step("net", 0, 8, ranks, "all_ranks")).view
    assert view[StepMetrics.net_rx_bytes] == np.sum([rx for rx, _ in sent.values()])
    assert view[StepMetrics.net_tx_bytes] == np.sum([tx for _, tx in sent.values()])
    bare = p0_view(reduce_step("net", 1, 1, [], "all_ranks")).view
    assert bare[StepMetrics.net_rx_bytes] is None and bare[StepMetrics.net_tx_bytes] is None


def test_the_registry_and_what_is_built_from_it_import_without_torch():
    """The registry sits beside the torch-free catalog: the schema, the seed map and the
    charts are built from it in a process where torch cannot be imported."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None; "
        "from probewire.stream.series import STEP_SERIES, CHARTS; "
        "from probewire.sinks.schema import MIGRATIONS; "
        "import probewire.stream.seed_map; print(len(STEP_SERIES))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == len(STEP_SERIES)


def test_every_charted_series_has_a_unit_and_its_chart_axis_names_it():
    """Units come from the registry: each row a chart draws declares its unit (never the
    catalog's UCUM "1" of a component), and the chart's axis names that unit (a chart that
    divides by ``scale`` shows the scaled unit of bytes: GiB)."""
    from probewire.stream.series import CHARTS

    for chart in CHARTS:
        for row in (s for s in STEP_SERIES if s.chart == chart.key):
            assert row.unit and row.unit != "1", (chart.key, row.name)
            if chart.scale == 1:
                assert row.unit in chart.unit, (chart.key, row.name, row.unit, chart.unit)
            else:
                assert (row.unit, chart.scale, chart.unit) == ("bytes", float(1 << 30), "GiB")
