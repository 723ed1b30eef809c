"""Two paths: a rank sends a step's scan-tier points apart from its step tier, and stage 2
stores and pages the step from the step tier alone; the scan-tier detail joins its step's
row whichever comes first, and the joined row is the one a single message makes. Detail of
a kept step is promoted even when it comes after the decision."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_update_ratio import train_step

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.catalog import CATALOG, Tier
from probewire.instrument.wire import decode_rank_step
from probewire.stream.records import CompleteReason, ReducedStep
from probewire.stream.reduce import reduce_step
from probewire.stream.series import StepMetrics as SM
from probewire.stream.split import wire_parts
from probewire.stream.stage2 import RunPipeline, Stage2Config, Stage2Output, detail_output

CFG = TinyConfig(seq_len=8, d_model=16, n_layer=2, n_head=2)
STEPS = 3


@pytest.fixture(scope="module")
def messages():
    """Three scan steps of the tiny model on two ranks, sent with a detail transport:
    (step-tier records, scan-tier records) per step."""
    main, detail = MemoryTransport(), MemoryTransport()
    for rank in range(2):
        torch.manual_seed(rank)
        model = TinyLM(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        identity = RankIdentity(run_id="two", rank=rank, world_size=2, coords={"dp": rank})
        config = ProbeConfig(cadence={"scan": 1}, telemetry=False, comm=False)
        monitor = attach(
            model, opt, identity=identity, config=config, transport=main, detail=detail
        )
        g = torch.Generator().manual_seed(10 + rank)
        for step in range(STEPS):
            tokens = torch.randint(0, 256, (4, CFG.seq_len), generator=g)
            targets = torch.randint(0, 256, (4, CFG.seq_len), generator=g)
            train_step(monitor, model, opt, step, tokens, targets)
        monitor.close()
    step_tier = [decode_rank_step(k, v) for k, v in main.messages]
    scan_tier = [decode_rank_step(k, v) for k, v in detail.messages]
    return {
        s: ([r for r in step_tier if r.step == s], [r for r in scan_tier if r.step == s])
        for s in range(STEPS)
    }


def reduced(messages, step):
    """(the step tier, the scan tier as stage 1 reduces each, the single-message step)."""
    own, scan = messages[step]
    whole = [
        dataclasses.replace(r, values={**r.values, **d.values})
        for r, d in zip(sorted(own, key=lambda r: r.rank), sorted(scan, key=lambda r: r.rank))
    ]
    return (
        reduce_step("two", step, 2, own, CompleteReason.ALL_RANKS),
        reduce_step("two", step, 2, scan, CompleteReason.SCAN),
        reduce_step("two", step, 2, whole, CompleteReason.ALL_RANKS),
    )


def rows(out):
    return out.rows.get("step_metrics", [])


def send_scan(run: RunPipeline, scan: ReducedStep, now: float) -> tuple[Stage2Output, bool]:
    """The scan step as stage 1 publishes it (``wire_parts``) and the worker takes it: its
    reduced values through stage 2 (returned), its detail parts as ``on_detail_step`` stores
    them (their look-back rows made; whether they are promoted once written, returned)."""
    out, kept = Stage2Output(), []
    for detail, data in wire_parts(scan, 1_000_000):
        if detail:
            item, matrix = ReducedStep.detail_from_bytes(data)
            assert detail_output(item, matrix).rows["tensor_stats_recent"]
            kept.append(run.detail_kept(item))
        else:
            out.extend(run.accept(ReducedStep.from_bytes(data), now))
    assert kept and len(set(kept)) == 1
    return out, kept[0]


def same(a: dict, b: dict) -> bool:
    def eq(x, y):
        return (
            isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)
        ) or x == y

    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


def test_the_two_paths_carry_every_point_once_split_by_tier(messages):
    for own, scan in messages.values():
        assert len(own) == len(scan) == 2
        assert all(CATALOG[n].tier is Tier.SCAN for r in scan for n, _ in r.values)
        assert not any(CATALOG[n].tier is Tier.SCAN for r in own for n, _ in r.values)


@pytest.mark.parametrize("scan_first", [False, True])
def test_the_joined_row_is_the_single_message_row_in_either_order(messages, scan_first):
    config = Stage2Config(retention_every_k=2, warmup_steps=0)
    whole_run, split_run = RunPipeline("two", config), RunPipeline("two", config)
    for step in range(STEPS):
        own, scan, whole = reduced(messages, step)
        (expected,) = rows(whole_run.accept(whole, float(step)))
        if scan_first:
            out, kept = send_scan(split_run, scan, float(step))
            assert rows(out) == [] and not kept  # held for its step, not yet decided
            (row,) = rows(split_run.accept(own, float(step)))
        else:
            (first,) = rows(split_run.accept(own, float(step)))
            assert first[SM.update_ratio] is None  # stored and scored without the detail
            out, kept = send_scan(split_run, scan, float(step))
            (row,) = rows(out)
            assert kept == (step % 2 == 0)  # its step was kept: its detail promoted after it
        assert row[SM.update_ratio] is not None and row[SM.update_ratio] > 0
        assert same(row, expected)


def test_a_scan_step_long_after_its_step_is_stored_as_detail_not_joined(messages):
    run = RunPipeline("two", Stage2Config())
    run.scans = type(run.scans)(keep_rows=1)
    own0, scan0, _ = reduced(messages, 0)
    own1, _, _ = reduced(messages, 1)
    run.accept(own0, 0.0)
    run.accept(own1, 1.0)  # step 0's row is no longer kept
    out, kept = send_scan(run, scan0, 2.0)
    assert rows(out) == []
    assert kept  # step 0 was kept (0 % k == 0): its late detail is promoted


def test_the_scan_tier_rules_score_a_late_scan_step_as_they_score_a_single_message(messages):
    """A residual bound every branch breaks: the scan step that joins its row after the
    step was scored pages ``residual_scale`` naming the same branch as the single-message
    step, and keeps the step's detail."""
    from probewire.stream.signals import DetectorConfig

    config = Stage2Config(detectors=DetectorConfig(residual_ratio_min=1e9), warmup_steps=0)
    whole_run, split_run = RunPipeline("two", config), RunPipeline("two", config)

    def pages(out):
        return [(a["step"], a["signal"], a["culprit"]) for a in out.rows.get("alerts", [])]

    for step in range(STEPS):
        own, scan, whole = reduced(messages, step)
        expected = pages(whole_run.accept(whole, float(step)))
        first = split_run.accept(own, float(step))
        late, _ = send_scan(split_run, scan, float(step))
        assert ("residual_scale" in {s for _, s, _ in expected}) == (step == 0)  # paged once
        assert pages(first) + pages(late) == expected
        if expected:
            assert step in late.promote
