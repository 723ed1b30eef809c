"""A step's fan-in by rank block: blocks gathered by the stage-1 assembler, their partials
through the wire, merged by ``MergeAssembler``, give the step the single reduction gives,
bit for bit; a block past its deadline and a block that never came leave their ranks
missing; a repeated block counts once."""

from __future__ import annotations

import struct

from probewire.instrument.wire import RankStep
from probewire.stream.assemble import BlockDone, StepAssembler
from probewire.stream.fanin import MergeAssembler, decode_block, encode_block
from probewire.stream.inputs import PER_RANK
from probewire.stream.records import CompleteReason
from probewire.stream.reduce import reduce_step
from probewire.stream.testing import SimRun

WORLD, B = 10, 4


def records(step: int, world: int = WORLD) -> list[RankStep]:
    from probewire.instrument.wire import series_key

    run = SimRun(run_id="fan", world_size=world, ddp=True, clip_threshold=1.0)
    return [
        RankStep(
            run_id="fan",
            step=step,
            rank=r,
            world_size=world,
            host=f"node{r // 4}",
            coords={"dp": r},
            values={series_key(p.name, p.labels): p.value for p in run.points(step, r) or ()},
        )
        for r in range(world)
    ]


def bits(values: dict) -> dict:
    return {k: struct.pack("<d", v) for k, v in values.items()}


def through_wire(done: BlockDone):
    return decode_block(encode_block(done.partial, done.complete))


def test_blocks_merged_equal_the_single_reduction_bit_for_bit():
    blocks = StepAssembler(30.0, block_ranks=B, per_rank_names=PER_RANK)
    merger = MergeAssembler(30.0, B, PER_RANK)
    for step in range(3):
        merged = []
        for record in reversed(records(step)):  # any order
            for done in blocks.add(record, 0.0).completed:
                assert isinstance(done, BlockDone) and done.complete
                assert sorted(done.detail.per_rank) == done.partial.ranks
                out, repeated = merger.add(*through_wire(done), 0.0)
                assert not repeated
                merged += out
        (step_out,) = merged
        single = reduce_step("fan", step, WORLD, records(step), CompleteReason.ALL_RANKS)
        assert bits(step_out.reduced) == bits(single.reduced)
        assert step_out.ranks_reporting == single.ranks_reporting and not step_out.ranks_missing
        assert step_out.hosts == single.hosts and step_out.coords == single.coords
        assert step_out.complete_reason == CompleteReason.ALL_RANKS
        assert step_out.per_rank == {
            r: {k: v for k, v in values.items() if k[0] in PER_RANK}
            for r, values in single.per_rank.items()
        }


def test_a_late_block_and_a_silent_block_leave_their_ranks_missing():
    blocks = StepAssembler(5.0, block_ranks=B, per_rank_names=PER_RANK)
    merger = MergeAssembler(8.0, B, PER_RANK)
    sent = [r for r in records(0) if r.rank not in (5, 8, 9)]  # block 2 (8, 9) never came
    done = [d for r in sent for d in blocks.add(r, 0.0).completed]
    assert [d.partial.block for d in done] == [0]
    done += blocks.expire(6.0)  # block 1 without rank 5
    assert [(d.partial.block, d.complete) for d in done] == [(0, True), (1, False)]
    for d in done:
        assert merger.add(*through_wire(d), 6.0) == ([], False)
    assert merger.add(*through_wire(done[0]), 6.5) == ([], True)  # a repeat counts once
    (step,) = merger.expire(14.0)
    single = reduce_step("fan", 0, WORLD, sent, CompleteReason.DEADLINE)
    assert bits(step.reduced) == bits(single.reduced)
    assert step.ranks_missing == [5, 8, 9] and step.complete_reason == CompleteReason.DEADLINE
    assert merger.add(*through_wire(done[1]), 15.0) == ([], True)  # after its merge


def test_a_job_within_one_block_is_reduced_whole_as_before():
    blocks = StepAssembler(30.0, block_ranks=16, per_rank_names=PER_RANK)
    done = [d for r in records(0) for d in blocks.add(r, 0.0).completed]
    single = reduce_step("fan", 0, WORLD, records(0), CompleteReason.ALL_RANKS)
    assert done == [single]
