"""Generated messages through decode, stage 1 and stage 2 (hypothesis): no exception
escapes, and each bad message is exactly one dead letter."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from probewire.instrument.catalog import Label, Loss, Moe, System
from probewire.instrument.export import Point, RankIdentity, StepEmitter
from probewire.instrument.testing import MemoryTransport
from probewire.instrument.wire import DecodeError, decode_rank_step
from probewire.stream.assemble import StepAssembler
from probewire.stream.records import ReducedStep
from probewire.stream.split import split_step
from probewire.stream.stage2 import RunPipeline, Stage2Config
from probewire.stream.validate import Bounds, StepValidator


def message(run_id: str, step: int, rank: int, world_size: int, points) -> tuple[bytes, bytes]:
    transport = MemoryTransport()
    emitter = StepEmitter(
        RankIdentity(
            run_id=run_id, rank=rank, world_size=world_size, host="h", coords={"dp": rank}
        ),
        transport,
    )
    emitter.emit(step, points)
    emitter.close()
    return transport.messages[0]


finite = st.floats(allow_nan=True, allow_infinity=True, width=64)
point = st.one_of(
    st.builds(lambda v: Point(Loss.SUM, v), finite),
    st.builds(lambda v: Point(Loss.TOKENS, v), finite),
    st.builds(lambda v: Point(System.STEP_TIME, v), finite),
    st.builds(lambda s, v: Point(Loss.SUM, v, ((Label.SOURCE, s),)), st.text(max_size=8), finite),
    st.builds(
        lambda e, v: Point(Moe.EXPERT_TOKENS, v, ((Label.EXPERT, e), (Label.LAYER, "0"))),
        st.sampled_from(["0", "1", "-1", "x", "4294967296"]),
        finite,
    ),
)
good_or_bad = st.one_of(
    st.builds(
        lambda step, rank, ws, pts: ("otlp", step, rank, ws, pts),
        st.integers(0, 2**62),
        st.integers(0, 7),
        st.integers(1, 8),
        st.lists(point, min_size=1, max_size=6),
    ),
    st.builds(lambda b: ("raw", b), st.binary(max_size=64)),
)


class Sink:
    """Stage 1 and stage 2 of one worker, without Kafka: dead letters are counted."""

    def __init__(self) -> None:
        self.validator = StepValidator(Bounds(max_step_ahead=1000, max_world_size=16))
        self.assembler = StepAssembler(5.0)
        self.runs: dict[str, RunPipeline] = {}
        self.dead = 0

    def stage2(self, reduced: ReducedStep, now: float) -> None:
        for _, data in split_step(reduced, 1_000_000):
            part = ReducedStep.from_bytes(data)
            run = self.runs.setdefault(part.run_id, RunPipeline(part.run_id, Stage2Config()))
            run.accept(part, now)

    def take(self, key: bytes, value: bytes, now: float) -> None:
        try:
            record = decode_rank_step(key, value)
        except DecodeError:
            self.dead += 1
            return
        checked = self.validator.check(record)
        if checked.reason is not None:
            self.dead += 1
        if checked.record is None:
            return
        result = self.assembler.add(checked.record, now)
        for reduced in result.completed:
            self.stage2(reduced, now)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(good_or_bad, min_size=1, max_size=12))
def test_generated_messages_never_raise_and_each_bad_one_is_one_dead_letter(messages):
    sink, now = Sink(), 0.0
    for m in messages:
        if m[0] == "raw":
            key, value = b"run:0", m[1]
        else:
            _, step, rank, ws, pts = m
            if rank >= ws:
                continue  # the emitter refuses it before it is sent
            key, value = message("run", step, rank, ws, pts)
        before = sink.dead
        sink.take(key, value, now)
        assert sink.dead - before <= 1  # one message, at most one dead letter
        now += 1.0
    for reduced in sink.assembler.expire(now + 10):
        sink.stage2(reduced, now + 10)
    for run in sink.runs.values():
        run.expire(now + 1000)


def test_a_null_payload_is_a_decode_error():
    with pytest.raises(DecodeError):
        decode_rank_step(b"run:0", None)
