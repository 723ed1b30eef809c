"""Rows per second through ``ClickHouseSink`` into embedded ClickHouse (chdb).

Run as its own process (chdb opens one data directory per process):

    python benchmarks/sink.py [--rows-step 50000] [--rows-rank 500000] [--repeat 5]

It opens a fresh temporary chdb directory, migrates the schema, and times
``ClickHouseSink.write`` (row dicts, what the stream hands over) and
``ClickHouseSink.write_columns`` (already column-wise) for a step_metrics-like batch
(every column of a step row) and a rank_metrics-like batch (7 narrow columns). Each
case has one warm-up insert, then ``--repeat`` timed inserts of fresh keys; the median
is printed as ``<case>: N rows/s``. Building the Python rows is not timed; converting
them to columns and the insert itself are. The goal is ≥ 500k rows/s.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from typing import Any

import numpy as np

from probewire.instrument.catalog import Grad, Loss, System
from probewire.sinks import TABLE_COLUMNS, ClickHouseSink, connect
from probewire.stream.series import StepMetrics as SM

# a 64-rank step's values, by registry column (stream.series.StepMetrics)
_STEP_VALUES = {
    SM.step_tokens: 4096 * 64,
    SM.loss_worst_rank_id: 0,
    SM.grad_norm: 0.9,
    SM.clip_rate: 0.01,
    SM.clipped: 0,
    SM.loss_z: 0.3,
    SM.grad_z: 0.4,
    SM.loss_spike: 0,
    SM.grad_spike: 0,
    SM.cospike: 0,
    SM.cospike_count: 0,
    SM.cospike_magnitude: 0.0,
    SM.step_time_s: 0.5,
    SM.tokens_per_s: 524288.0,
    SM.compute_rate: 1.5e14,
    SM.straggler_score: 1.02,
    SM.straggler_rank: 7,
    SM.peak_memory_bytes: 7.1e10,
    SM.peak_memory_rank: 3,
    SM.moe_maxvio: 0.12,
    SM.moe_shard_imbalance: 1.05,
    SM.moe_h_norm: 0.97,
    SM.output_absmax: 31.0,
    SM.skipped: 0,
    SM.replayed: 0,
    SM.replay_mismatch: 0,
    SM.ranks_reporting: 64,
    SM.ranks_missing: [],
    SM.complete_reason: "all_ranks",
    SM.warmup: 0,
}


def _step_rows(run_id: str, start: int, n: int, rng: np.random.Generator) -> list[dict]:
    loss = rng.uniform(2, 4, n)
    rows = []
    for i in range(n):
        step = start + i
        row = {str(k): v for k, v in _STEP_VALUES.items()}
        row.update(
            {
                SM.run_id.name: run_id,
                SM.step.name: step,
                SM.tokens.name: 4096 * 64 * step,
                SM.flops.name: 1e15 * step,
                SM.loss.name: float(loss[i]),
                SM.loss_worst_rank.name: float(loss[i]) + 0.1,
                SM.loss_worst_rank_id.name: i % 64,
            }
        )
        rows.append(row)
    return rows


def _rank_rows(run_id: str, start: int, n: int, ranks: int, rng: np.random.Generator) -> list[dict]:
    values = rng.uniform(0, 1, n)
    metrics = (Loss.SUM, Loss.TOKENS, Grad.NORM_SQ, System.STEP_TIME)
    return [
        {
            "run_id": run_id,
            "step": start + i // (ranks * len(metrics)),
            "rank": i % ranks,
            "metric": metrics[(i // ranks) % len(metrics)],
            "labels": "",
            "value": float(values[i]),
            "late": 0,
        }
        for i in range(n)
    ]


def _columns(rows: list[dict]) -> dict[str, list]:
    return {name: [r[name] for r in rows] for name in rows[0]}


def _bench(label: str, insert, batches: list, repeat: int) -> float:
    insert(batches[0])  # warm-up: first insert creates parts, caches, dictionaries
    rates = []
    for batch in batches[1 : repeat + 1]:
        n = len(batch) if isinstance(batch, list) else len(next(iter(batch.values())))
        started = time.perf_counter()
        insert(batch)
        rates.append(n / (time.perf_counter() - started))
    rate = statistics.median(rates)
    print(f"{label}: {rate:,.0f} rows/s (median of {repeat}, {n:,} rows per batch)")
    return rate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows-step", type=int, default=50_000)
    parser.add_argument("--rows-rank", type=int, default=500_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    store = tempfile.mkdtemp(prefix="probewire-bench-")
    try:
        client = connect("chdb:///" + store.lstrip("/"))
        print(
            f"# python {platform.python_version()}, chdb {version('chdb')}, "
            f"clickhouse-connect {version('clickhouse-connect')}, {os.cpu_count()} CPUs, "
            f"{platform.machine()}; store {store}"
        )
        print(
            f"# step_metrics: {len(TABLE_COLUMNS['step_metrics'])} columns; "
            f"rank_metrics: {len(TABLE_COLUMNS['rank_metrics'])} columns"
        )
        cases = _cases(args, np.random.default_rng(0))
        results, stored_ok = _bench_cases(client, cases, args)
        print(
            f"step_metrics engine only (INSERT SELECT, no client): "
            f"{_engine_ceiling(client, args):,.0f} rows/s (reference ceiling)"
        )
        goal = 500_000
        print(
            f"# rows stored as expected: {stored_ok}; goal {goal:,} rows/s met by: "
            + ", ".join(f"{c[0]} {c[1]}" for c, r in zip(cases, results) if r >= goal)
        )
        return 0 if stored_ok else 1
    finally:
        shutil.rmtree(store, ignore_errors=True)


def _cases(args: argparse.Namespace, rng: np.random.Generator) -> tuple:
    """(table, write method, the k-th batch's maker) for each measured way of writing."""
    return (
        ("step_metrics", "write(rows)", lambda k: _step_rows(f"r{k}", 0, args.rows_step, rng)),
        (
            "rank_metrics",
            "write(rows)",
            lambda k: _rank_rows(f"r{k}", 0, args.rows_rank, 64, rng),
        ),
        (
            "step_metrics",
            "write_columns",
            lambda k: _columns(_step_rows(f"r{k}", 0, args.rows_step, rng)),
        ),
        (
            "rank_metrics",
            "write_columns",
            lambda k: _columns(_rank_rows(f"r{k}", 0, args.rows_rank, 64, rng)),
        ),
    )


def _bench_cases(client: Any, cases: tuple, args: argparse.Namespace) -> tuple[list, bool]:
    """Each case's rows/s through the sink, and whether every case stored all its rows."""
    n = args.repeat + 1
    results, stored_ok = [], True
    for i, (table, how, make) in enumerate(cases):
        # A fresh database per case, so one case's background merges do not slow the next.
        sink = ClickHouseSink(client, f"bench{i}", batch_rows=max(args.rows_step, args.rows_rank))
        sink.migrate()
        write = getattr(sink, "write" if how == "write(rows)" else "write_columns")
        results.append(
            _bench(
                f"{table} {how}",
                functools.partial(write, table),
                [make(k) for k in range(n)],
                args.repeat,
            )
        )
        rows = args.rows_step if table == "step_metrics" else args.rows_rank
        stored = client.query(f"SELECT count() FROM bench{i}.{table}").result_rows[0][0]
        stored_ok &= stored == n * rows
        client.command(f"DROP DATABASE bench{i} SYNC")
    return results, stored_ok


_CEILING_COLUMNS = ", ".join(
    (
        SM.run_id,
        SM.step,
        SM.tokens,
        SM.loss,
        SM.loss_worst_rank,
        SM.loss_worst_rank_id,
        SM.grad_norm,
        SM.clip_rate,
        SM.loss_z,
        SM.grad_z,
        SM.step_time_s,
        SM.tokens_per_s,
        SM.compute_rate,
        SM.straggler_score,
        SM.straggler_rank,
        SM.peak_memory_bytes,
        SM.peak_memory_rank,
        SM.moe_maxvio,
        SM.moe_shard_imbalance,
        SM.moe_h_norm,
        SM.output_absmax,
        SM.complete_reason,
    )
)


def _engine_ceiling(client: Any, args: argparse.Namespace) -> float:
    """The engine's own ceiling for the wide table: rows generated inside ClickHouse
    (median rows/s of the repeats after the first)."""
    sink = ClickHouseSink(client, "ceiling")
    sink.migrate()
    rates = []
    for k in range(args.repeat + 1):
        started = time.perf_counter()
        client.command(
            f"INSERT INTO ceiling.step_metrics ({_CEILING_COLUMNS}) SELECT 'c{k}', number, "
            "number * 100, rand() / 1e9, rand() / 1e9, number % 64, 1, 0.01, 0.3, 0.4, 0.5, "
            f"5e5, 1e14, 1.02, 7, 7e10, 3, 0.1, 1.05, 0.97, 31, 'all_ranks' "
            f"FROM numbers({args.rows_step})"
        )
        rates.append(args.rows_step / (time.perf_counter() - started))
    return statistics.median(rates[1:])


if __name__ == "__main__":
    sys.exit(main())
