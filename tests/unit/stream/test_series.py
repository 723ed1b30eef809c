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
from probewire.stream.assemble import reduce_step
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
    assert MIGRATIONS[-1].version == 8 and sink.migrate() == 8
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
    """A store at version 7 (no memory_capacity_bytes, memory_headroom) is upgraded by the
    migration the two registry rows make: they land at the end of step_metrics, rows kept."""
    db = ch_database + "_v7"
    table = next(t for t in TABLES if t.name == "step_metrics")
    new = {"memory_capacity_bytes", "memory_headroom"}
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
    assert ClickHouseSink(ch_client, db).migrate() == 8
    names = [
        r[0]
        for r in ch_client.query(
            f"SELECT name FROM system.columns WHERE database = '{db}' "
            "AND table = 'step_metrics' ORDER BY position"
        ).result_rows
    ]
    assert names == [c.name for c in table.columns]
    assert names[-3:] == ["memory_capacity_bytes", "memory_headroom", "inserted_at"]
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
