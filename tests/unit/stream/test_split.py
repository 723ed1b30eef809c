"""Reduced steps over the message limit: parts that fit, P0 last and whole, rows unsplit."""

from __future__ import annotations

import pytest

from probewire.instrument.catalog import Label, Loss, System, Tensor
from probewire.instrument.wire import RankStep, series_key
from probewire.stream.records import CompleteReason, ReducedStep
from probewire.stream.reduce import reduce_step
from probewire.stream.split import OversizeStep, split_step
from probewire.stream.stage2 import RunPipeline, Stage2Config, column_rows
from probewire.stream.view import p0_view


def big_step(ranks=16, tensors=60) -> ReducedStep:
    records = []
    for r in range(ranks):
        values = {
            series_key(Loss.SUM): 3.0 * (r + 1),
            series_key(Loss.TOKENS): float(r + 1),
            series_key(System.STEP_TIME): 0.1 + r / 100,
        }
        for t in range(tensors):
            for name in Tensor.ALL:
                values[series_key(name, {Label.TENSOR: f"t{t}", Label.KIND: "fwd"})] = t + r
        records.append(
            RankStep(
                run_id="r",
                step=0,
                rank=r,
                world_size=ranks,
                host=f"h{r}",
                coords={"dp": r},
                values=values,
            )
        )
    return reduce_step("r", 0, ranks, records, "all_ranks")


def rows(parts) -> dict[str, list]:
    run = RunPipeline("r", Stage2Config())
    out = {}
    for _part, data in parts:
        got = run.accept(ReducedStep.from_bytes(data), now=0.0)
        for table, table_rows in got.rows.items():
            out.setdefault(table, []).extend(table_rows)
        for table, columns in got.columns.items():
            out.setdefault(table, []).extend(column_rows(columns))
    return out


def test_a_step_under_the_limit_is_one_message():
    step = big_step(ranks=2, tensors=2)
    ((part, data),) = split_step(step, 1_000_000)
    assert part is step and data == step.to_bytes()


def test_an_oversize_step_becomes_parts_under_the_limit_with_the_same_rows():
    step = big_step()
    limit = 15_000
    assert len(step.to_bytes()) > 4 * limit
    parts = split_step(step, limit)
    assert all(len(data) <= limit for _, data in parts)
    assert [p.complete_reason for p, _ in parts] == [CompleteReason.DETAIL] * (len(parts) - 1) + [
        "all_ranks"
    ]
    main = parts[-1][0]
    assert p0_view(main) == p0_view(step)  # P0 whole in the main part
    whole, split = rows([(step, step.to_bytes())]), rows(parts)

    def key(row):
        return sorted((k, str(v)) for k, v in row.items())

    for table in ("rank_metrics_recent", "tensor_stats_recent", "step_metrics"):
        assert sorted(map(key, split[table])) == sorted(map(key, whole[table])), table


def test_a_single_series_over_the_limit_is_refused():
    with pytest.raises(OversizeStep):
        split_step(big_step(ranks=2, tensors=2), 200)  # even the P0 part is over
