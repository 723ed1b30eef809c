"""Reduced steps over the message limit: parts that fit, P0 last and whole, rows unsplit;
what stage 1 sends to the detail topic and what to stage 2's ordered path."""

from __future__ import annotations

import dataclasses

import pytest

from probewire.instrument.catalog import Label, Loss, System, Tensor
from probewire.instrument.wire import RankStep, series_key
from probewire.stream.records import CompleteReason, ReducedStep
from probewire.stream.reduce import reduce_step
from probewire.stream.split import OversizeStep, split_step, wire_parts
from probewire.stream.stage2 import RunPipeline, Stage2Config, column_rows, detail_output
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


def rows(parts, run: RunPipeline | None = None) -> dict[str, list]:
    """The rows the worker stores for ``parts`` ((to the detail topic?, bytes)): detail as
    ``on_detail_step`` makes it, the rest through stage 2."""
    run = run or RunPipeline("r", Stage2Config())
    out: dict[str, list] = {}
    for detail, data in parts:
        if detail:
            got = run.name_tensors(detail_output(*ReducedStep.detail_from_bytes(data)))
        else:
            got = run.accept(ReducedStep.from_bytes(data), now=0.0)
        for table, table_rows in got.rows.items():
            out.setdefault(table, []).extend(table_rows)
        for table, columns in got.columns.items():
            out.setdefault(table, []).extend(column_rows(columns))
    return out


def key(row):
    return sorted((k, str(v)) for k, v in row.items())


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
    sent = wire_parts(step, limit)
    assert [d for d, _ in sent] == [True] * (len(parts) - 1) + [False]  # detail apart
    assert [data for _, data in sent] == [data for _, data in parts]
    whole, split = rows([(False, step.to_bytes())]), rows(sent)
    for table in ("rank_metrics_recent", "tensor_stats_recent", "tensor_names", "step_metrics"):
        assert sorted(map(key, split[table])) == sorted(map(key, whole[table])), table


def test_a_scan_step_sends_its_detail_apart_and_its_reduced_values_to_stage_2():
    """The scan-tier step's per-rank values and tensor statistics go to the detail topic
    (as they would have been stored from one message), its reduced values alone to stage
    2: no per-rank value on the ordered path, whatever the limit (under a small one, the
    reduced values that do not fit go to the detail topic too, stored twice, harmlessly)."""
    step = dataclasses.replace(big_step(), complete_reason=CompleteReason.SCAN)
    alone = dataclasses.replace(step, complete_reason=CompleteReason.DETAIL)
    want = rows([(True, alone.to_bytes())])
    for limit in (15_000, 10_000_000):
        sent = wire_parts(step, limit)
        to_stage2 = [ReducedStep.from_bytes(data) for detail, data in sent if not detail]
        assert [p.complete_reason for p in to_stage2] == [CompleteReason.SCAN]
        assert to_stage2[0].per_rank == {} and to_stage2[0].hosts == {}
        assert set(to_stage2[0].reduced.items()) <= set(step.reduced.items())
        if limit > len(step.to_bytes()):
            assert to_stage2[0].reduced == step.reduced
        got = rows([(d, data) for d, data in sent if d])
        for table in ("rank_metrics_recent", "tensor_stats_recent"):
            assert len(got[table]) > 0
            unique = {tuple(map(tuple, key(r))) for r in got[table]}
            assert sorted(unique) == sorted(tuple(map(tuple, key(r))) for r in want[table])


def test_a_replay_goes_whole_to_the_detail_topic_and_stage_2_refuses_one_sent_to_it():
    step = dataclasses.replace(big_step(), complete_reason=CompleteReason.REPLAY)
    assert all(detail for detail, _ in wire_parts(step, 15_000))
    out = RunPipeline("r", Stage2Config()).accept(step, now=0.0)
    assert out.refused == [(0, "replay detail on the steps topic")] and not out.rows


def test_a_single_series_over_the_limit_is_refused():
    with pytest.raises(OversizeStep):
        split_step(big_step(ranks=2, tensors=2), 200)  # even the P0 part is over
