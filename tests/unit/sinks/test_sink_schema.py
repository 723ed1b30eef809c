"""The migrated schema: tables as declared, views that compute the seed definitions."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from probewire.deploy.demo.simulate import simulated_run
from probewire.sinks import TABLE_COLUMNS, TABLES, VIEWS, ClickHouseSink
from probewire.sinks.retained import promote
from probewire.sinks.schema import (
    _STEP_METRICS_V2,
    _STEP_METRICS_V3,
    _STEP_METRICS_V4,
    GRAD_GROUP_STATS,
    RESIDUAL_STATS,
    TENSOR_NAMES,
    USER_METRICS,
)
from probewire.stream import derive
from probewire.stream.records import RankMatrix, ReducedStep
from probewire.stream.series import STEP_SERIES
from probewire.stream.view import rank_rows, rank_table


@pytest.fixture()
def sink(ch_client, ch_database) -> ClickHouseSink:
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    return sink


def _rows(client, sql: str) -> list[tuple]:
    return client.query(sql).result_rows


def test_migrated_tables_have_exactly_the_declared_columns_and_types(ch_client, sink) -> None:
    db = sink.database
    for table in TABLES:
        got = _rows(
            ch_client,
            f"SELECT name, type FROM system.columns WHERE database = '{db}' "
            f"AND table = '{table.name}' ORDER BY position",
        )
        assert got == [(c.name, c.type) for c in table.columns], table.name
        engine = _rows(
            ch_client,
            f"SELECT engine, sorting_key FROM system.tables "
            f"WHERE database = '{db}' AND name = '{table.name}'",
        )
        assert engine == [("ReplacingMergeTree", ", ".join(table.key))], table.name
    views = {
        r[0]
        for r in _rows(
            ch_client, f"SELECT name FROM system.tables WHERE database = '{db}' AND engine = 'View'"
        )
    }
    assert views == {v.name for v in VIEWS}


def test_migrate_is_idempotent_and_records_each_version_once(ch_client, sink) -> None:
    assert sink.migrate() == 12
    assert _rows(
        ch_client, f"SELECT version FROM {sink.database}.schema_migrations ORDER BY version"
    ) == [(1,), (2,), (3,), (4,), (5,), (6,), (7,), (8,), (9,), (10,), (11,), (12,)]


def test_look_back_inserts_skip_the_block_merge_and_read_back_the_same(ch_client, sink) -> None:
    """A look-back table's insert keeps the block's rows as sent (no merge on insert: the
    engine's cost halves); FINAL, in the table and after promotion, still reads each key's
    last row, as the merge on insert would have kept it."""
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    sink.write_columns(
        "rank_metrics_recent",
        {
            "run_id": ["r"] * 6,
            "step": [1, 1, 2, 1, 1, 1],
            "rank": [0, 0, 0, 1, 0, 0],
            "metric": ["loss.sum"] * 6,
            "labels": [""] * 6,
            "value": values,
            "late": [0, 1, 0, 0, 1, 0],
        },
    )
    db = sink.database
    assert _rows(ch_client, f"SELECT count() FROM {db}.rank_metrics_recent") == [(6,)]
    last = [(1, 0, 6.0, 0), (1, 1, 4.0, 0), (2, 0, 3.0, 0)]
    read = "SELECT step, rank, value, late FROM {db}.{table} FINAL ORDER BY step, rank"
    assert _rows(ch_client, read.format(db=db, table="rank_metrics_recent")) == last
    promote(sink, "r", [1, 2])
    assert _rows(ch_client, read.format(db=db, table="rank_metrics")) == last


def test_an_arrow_column_batch_reads_back_bit_for_bit(ch_client, sink) -> None:
    """The detail path's column batch (``view.rank_table`` of two steps: Arrow, strings as
    dictionaries) is stored in slices
    of ``batch_rows`` and reads back bit for bit, NaN and infinities included, the label
    dictionaries stored as plain strings."""
    rng = np.random.default_rng(3)
    r, k = 37, 11
    keys = [(f"m{j % 4}", (("tensor", f"t{j}"),)) for j in range(k)]
    tables, expected = [], []
    for step in (5, 6):
        values = rng.standard_normal((r, k))
        values[0, :3] = [np.nan, np.inf, -np.inf]
        mask = (rng.random((r, k)) < 0.8).astype(np.uint8)
        item = ReducedStep(
            run_id="arrow",
            step=step,
            world_size=r,
            ranks_reporting=list(range(r)),
            ranks_missing=[],
            reduced={},
            per_rank={},
        )
        tables.append(rank_rows(item, RankMatrix(keys, list(range(r)), values, mask)))
        expected += [
            (step, i, keys[j][0], f"tensor=t{j}", values[i, j].tobytes())
            for i in range(r)
            for j in range(k)
            if mask[i, j]
        ]
    small = dataclasses.replace(sink, batch_rows=100)
    assert small.write_columns("rank_metrics_recent", rank_table(tables)) == len(expected)
    got = _rows(
        ch_client,
        f"SELECT step, rank, metric, labels, value FROM {sink.database}.rank_metrics_recent "
        "WHERE run_id = 'arrow'",
    )
    assert sorted((s, i, m, lab, np.float64(v).tobytes()) for s, i, m, lab, v in got) == sorted(
        expected
    )


def test_a_large_step_metrics_insert_writes_one_compact_part(ch_client, sink) -> None:
    """Migration 5: 50,000 rows of the wide table go into one compact part (one data file),
    not a wide part of one or two files per column, and read back unchanged."""
    sink.migrate()
    n = 50_000
    sink.write_columns(
        "step_metrics",
        {
            "run_id": ["c"] * n,
            "step": list(range(n)),
            "tokens": [10 * i for i in range(n)],
            "loss": [None if i % 7 == 0 else i / 8 for i in range(n)],
        },
    )
    db = sink.database
    assert _rows(
        ch_client,
        f"SELECT part_type, rows FROM system.parts WHERE database = '{db}' "
        "AND table = 'step_metrics' AND active",
    ) == [("Compact", n)]
    assert _rows(
        ch_client,
        f"SELECT count(), sum(tokens), sum(loss), countIf(loss IS NULL) FROM {db}.step_metrics",
    ) == [
        (
            n,
            sum(10 * i for i in range(n)),
            sum(i / 8 for i in range(n) if i % 7),
            len(range(0, n, 7)),
        )
    ]


def test_a_version_1_store_is_upgraded_to_the_declared_step_metrics(ch_client, ch_database) -> None:
    """A store migrated before version 2 (step_metrics without the structure columns, the
    learning rates of version 3 and the formed series of version 4, no grad_group_stats, no
    tensor_names of version 5) gets them, in the declared order, and keeps its rows."""
    db = ch_database + "_v1"
    table = next(t for t in TABLES if t.name == "step_metrics")
    later = {c.name for c in (*_STEP_METRICS_V2, *_STEP_METRICS_V3, *_STEP_METRICS_V4)}
    later |= {s.name for s in STEP_SERIES if s.since > 1}  # and every column added since
    old = dataclasses.replace(table, columns=tuple(c for c in table.columns if c.name not in later))
    ch_client.command(f"CREATE DATABASE IF NOT EXISTS {db}")
    ch_client.command(
        f"CREATE TABLE {db}.schema_migrations (version UInt32, description "
        "String, applied_at DateTime64(3) DEFAULT now64(3)) "
        "ENGINE = ReplacingMergeTree ORDER BY version"
    )
    ch_client.command(f"INSERT INTO {db}.schema_migrations (version, description) VALUES (1, 'v1')")
    for t in TABLES:
        if t not in (GRAD_GROUP_STATS, TENSOR_NAMES, RESIDUAL_STATS, USER_METRICS):
            ch_client.command((old if t is table else t).ddl(db))
    ch_client.command(
        f"INSERT INTO {db}.step_metrics (run_id, step, tokens, loss) VALUES ('r', 7, 10, 2.5)"
    )
    assert ClickHouseSink(ch_client, db).migrate() == 12
    got = _rows(
        ch_client,
        f"SELECT name, type FROM system.columns WHERE database = '{db}' "
        "AND table = 'step_metrics' ORDER BY position",
    )
    assert got == [(c.name, c.type) for c in table.columns]
    assert _rows(
        ch_client, f"SELECT step, loss, media_scale, grad_abs_mean FROM {db}.step_metrics"
    ) == [(7, 2.5, None, None)]
    assert _rows(
        ch_client,
        f"SELECT name, type FROM system.columns WHERE database = '{db}' "
        "AND table = 'grad_group_stats' ORDER BY position",
    ) == [(c.name, c.type) for c in GRAD_GROUP_STATS.columns]
    assert _rows(
        ch_client,
        f"SELECT name, type FROM system.columns WHERE database = '{db}' "
        "AND table = 'tensor_names' ORDER BY position",
    ) == [(c.name, c.type) for c in TENSOR_NAMES.columns]


def test_sensitive_artifacts_exist_only_when_opted_in_with_their_ttl(ch_client, sink) -> None:
    db = sink.database

    def ttl() -> list[tuple]:
        return _rows(
            ch_client,
            f"SELECT engine_full FROM system.tables WHERE database = "
            f"'{db}' AND name = 'sensitive_artifacts'",
        )

    assert ttl() == []
    sink.migrate(sensitive_artifacts=True, sensitive_ttl_days=3)
    assert "toIntervalDay(3)" in ttl()[0][0]
    sink.migrate(sensitive_artifacts=True, sensitive_ttl_days=5)
    assert "toIntervalDay(5)" in ttl()[0][0]
    with pytest.raises(ValueError):
        sink.migrate(sensitive_artifacts=True, sensitive_ttl_days=365)


def test_every_column_the_stream_writes_is_known_to_the_writer() -> None:
    run = simulated_run("cols", steps=12, retain_every=5)
    for table, rows in run.tables.items():
        assert set().union(*rows) <= set(TABLE_COLUMNS[table]), table


def test_a_row_with_only_some_columns_takes_the_defaults_for_the_rest(ch_client, sink) -> None:
    sink.write(
        "step_metrics",
        [
            {
                "run_id": "r",
                "step": 3,
                "tokens": 300,
                "loss": 2.5,
                "ranks_missing": [1],
                "complete_reason": "deadline",
            }
        ],
    )
    got = _rows(
        ch_client,
        f"SELECT loss, ranks_missing, flops, clip_rate, cospike_count, "
        f"moe_maxvio FROM {sink.database}.step_metrics FINAL",
    )
    assert got == [(2.5, [1], 0.0, None, 0, None)]


def test_tensor_view_matches_the_reference_formulas(ch_client, sink) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_t(df=5, size=5000) * 0.3 + 0.1
    x[:40] = 0.0
    row = {
        "run_id": "r",
        "step": 100,
        "tensor": "layers.0.mlp",
        "kind": "param",
        "n": float(x.size),
        "sum": float(x.sum()),
        "sum_sq": float((x**2).sum()),
        "abs_sum": float(np.abs(x).sum()),
        "abs_max": float(np.abs(x).max()),
        "zeros": float((x == 0).sum()),
        "nonfinite": 0.0,
        "sum3": float((x**3).sum()),
        "sum4": float((x**4).sum()),
    }
    c = np.full(1000, 0.1)  # zero variance (raw sums cannot resolve it): no kurtosis
    constant = row | {
        "tensor": "constant",
        "n": 1000.0,
        "sum": float(c.sum()),
        "sum_sq": float((c**2).sum()),
        "sum3": float((c**3).sum()),
        "sum4": float((c**4).sum()),
    }
    # 25 non-finite elements more: counted in n, left out of the power sums (as the scan)
    nonfinite = row | {"tensor": "nonfinite", "n": float(x.size + 25), "nonfinite": 25.0}
    sink.write(
        "tensor_stats",
        [row, row | {"tensor": "no_moments", "sum3": None, "sum4": None}, constant, nonfinite],
    )
    got = _rows(
        ch_client,
        f"SELECT tensor, rms, abs_mean, zero_frac, excess_kurtosis, mean "
        f"FROM {sink.database}.tensor_view ORDER BY tensor",
    )
    (
        (_, _, _, _, flat, _),
        (name, rms, abs_mean, zero_frac, kurt, mean),
        (_, _, _, _, none, _),
        (_, rms_nf, abs_mean_nf, zero_frac_nf, kurt_nf, mean_nf),
    ) = got
    assert (rms_nf, abs_mean_nf, mean_nf) == pytest.approx(
        (math.sqrt(np.mean(x**2)), np.mean(np.abs(x)), np.mean(x)), rel=1e-12
    )
    assert zero_frac_nf == pytest.approx(40 / (5000 + 25))  # Z_x = zeros / N (all elements)
    assert name == "layers.0.mlp" and none is None and flat is None
    assert rms == pytest.approx(math.sqrt(np.mean(x**2)), rel=1e-12)
    assert abs_mean == pytest.approx(np.mean(np.abs(x)), rel=1e-12)
    assert mean == pytest.approx(np.mean(x), rel=1e-12)
    assert zero_frac == pytest.approx(40 / 5000)
    centered = x - x.mean()
    reference = np.mean(centered**4) / np.mean(centered**2) ** 2 - 3
    assert kurt == pytest.approx(reference, rel=1e-6)
    assert kurt_nf == pytest.approx(reference, rel=1e-6)


def test_expert_balance_view_matches_derive(ch_client, sink) -> None:
    loads = [120.0, 30.0, 0.0, 50.0, 80.0, 20.0]
    shards = [0, 0, 1, 1, 2, 2]
    sink.write(
        "expert_stats",
        [
            {
                "run_id": "r",
                "step": 5,
                "layer": "layers.1.moe",
                "expert": e,
                "tokens": c,
                "shard": s,
            }
            for e, (c, s) in enumerate(zip(loads, shards))
        ]
        + [
            {"run_id": "r", "step": 5, "layer": "empty", "expert": e, "tokens": 0.0, "shard": 0}
            for e in range(4)
        ],
    )
    got = _rows(
        ch_client,
        f"SELECT layer, imbalance, max_violation, h_norm, dead_ratio, "
        f"busiest_expert, shard_imbalance FROM {sink.database}.expert_balance",
    )
    ref = derive.expert_balance(loads)
    assert len(got) == 1  # a layer with no valid token is not a measured zero
    layer, imbalance, maxvio, h_norm, dead, busiest, shard = got[0]
    assert layer == "layers.1.moe" and busiest == 0
    assert (imbalance, maxvio, h_norm, dead) == pytest.approx(
        (ref.imbalance, ref.max_violation, ref.entropy_norm, ref.dead_ratio), rel=1e-12
    )
    assert shard == pytest.approx(derive.shard_imbalance(loads, shards), rel=1e-12)


def test_first_screen_carries_the_latest_reference_bpb_at_or_before_each_step(
    ch_client, sink
) -> None:
    sink.write("step_metrics", [{"run_id": "r", "step": s, "tokens": 100 * s} for s in range(6)])
    evals = [(2, "raw", 1, 1.5), (2, "ema", 0, 1.1), (4, "raw", 1, 1.3)]
    sink.write(
        "evaluations",
        [
            {
                "run_id": "r",
                "step": s,
                "suite": "heldout",
                "metric": "bpb",
                "value": v,
                "weights_stream": w,
                "reference": ref,
            }
            for s, w, ref, v in evals
        ]
        + [
            {
                "run_id": "r",
                "step": 1,
                "suite": "heldout",
                "metric": "nll",
                "value": 9.0,
                "reference": 1,
            }
        ],
    )
    got = _rows(
        ch_client,
        f"SELECT step, heldout_bpb, heldout_bpb_step FROM "
        f"{sink.database}.first_screen WHERE run_id = 'r' ORDER BY step",
    )
    assert got == [
        (0, None, None),
        (1, None, None),
        (2, 1.5, 2),
        (3, 1.5, 2),
        (4, 1.3, 4),
        (5, 1.3, 4),
    ]


def test_a_row_the_store_refuses_is_bisected_out_and_the_rest_stored(ch_client, sink) -> None:
    """One out-of-range value (expert -1 in a UInt32 column) comes back with the store's
    reason; the other rows of its write are stored once (the run-grade batch rule)."""
    rows = [
        {"run_id": "r", "step": s, "layer": "0", "expert": e, "tokens": 1.0}
        for s in range(3)
        for e in range(4)
    ]
    bad = {"run_id": "r", "step": 1, "layer": "0", "expert": -1, "tokens": 1.0}
    refused = sink.write_or_reject("expert_stats", rows[:5] + [bad] + rows[5:])
    assert [row for row, _ in refused] == [bad]
    assert refused[0][1].startswith("expert_stats: ")
    got = _rows(
        ch_client,
        f"SELECT step, expert FROM {sink.database}.expert_stats FINAL ORDER BY step, expert",
    )
    assert got == [(r["step"], r["expert"]) for r in rows]


def test_stage2s_tensor_names_rows_are_stored_once_per_run_and_tensor(ch_client, sink) -> None:
    """What a simulated run's stage 2 writes to tensor_names lands with its dimensions; a
    re-delivery of a row leaves one row per (run, tensor)."""
    run = simulated_run("names", steps=12, retain_every=5)
    rows = run.tables["tensor_names"]
    assert rows and len({r["tensor"] for r in rows}) == len(rows)
    sink.write("tensor_names", rows + rows[:1])
    got = _rows(
        ch_client,
        f"SELECT tensor, layer, role, expert FROM {sink.database}"
        ".tensor_names FINAL WHERE run_id = 'names' ORDER BY tensor",
    )
    assert got == sorted((r["tensor"], r["layer"], r["role"], r["expert"]) for r in rows)


def test_a_version_11_runs_table_gets_the_note_and_tags_of_version_12(ch_client, ch_database):
    """Migration 12: a store's ``runs`` of before (no note, no tags) gets both, after
    ``planned_tokens`` in the declared order, and keeps its rows (note '', no tags)."""
    db = ch_database + "_v11"
    runs = next(t for t in TABLES if t.name == "runs")
    old = dataclasses.replace(
        runs, columns=tuple(c for c in runs.columns if c.name not in ("note", "tags"))
    )
    ClickHouseSink(ch_client, db).migrate()
    ch_client.command(f"DROP TABLE {db}.runs")
    ch_client.command(old.ddl(db))
    ch_client.command(f"ALTER TABLE {db}.schema_migrations DELETE WHERE version = 12")
    ch_client.command(f"INSERT INTO {db}.runs (run_id, world_size) VALUES ('r', 4)")
    assert ClickHouseSink(ch_client, db).migrate() == 12
    got = _rows(
        ch_client,
        f"SELECT name, type FROM system.columns WHERE database = '{db}' "
        "AND table = 'runs' ORDER BY position",
    )
    assert got == [(c.name, c.type) for c in runs.columns]
    assert _rows(ch_client, f"SELECT run_id, world_size, note, tags FROM {db}.runs") == [
        ("r", 4, "", [])
    ]
