"""A user's own metrics on the rank (``Monitor.log``, ``StepContext.log``): the call-site
checks (name, value, reduction, step), the per-run bound with its counted drop, which step a
value goes with, and the points a monitor sends for it."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from probewire.deploy.demo.model import TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, NullMonitor, ProbeConfig, RankIdentity, attach
from probewire.instrument.catalog import Label, User
from probewire.instrument.userlog import NAME_MAX, UserLog, name_problem, points
from probewire.instrument.wire import Point, decode_rank_step


@pytest.mark.parametrize("name", ["val_acc", "eval/acc", "loader.wait-s", "A", "x" * NAME_MAX])
def test_good_names_pass(name):
    assert name_problem(name) is None
    UserLog(rank=0).log(name, 1.0)


@pytest.mark.parametrize(
    "name", ["", "1acc", "_acc", "val acc", "acc|x", "acc=1", "é", "x" * (NAME_MAX + 1), None, 3]
)
def test_bad_names_are_one_line_errors_at_the_call(name):
    with pytest.raises(ValueError) as err:
        UserLog(rank=0).log(name, 1.0)
    text = str(err.value)
    assert "\n" not in text and "letters, digits" in text and repr(name) in text


def test_bad_value_reduction_and_step_are_one_line_errors():
    user = UserLog(rank=0)
    with pytest.raises(TypeError, match=r"log\('acc', value\): value must be a number.*str"):
        user.log("acc", "0.5")
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, max, rank0"):
        user.log("acc", 0.5, "median")
    user.log("acc", 0.5, "max")
    with pytest.raises(ValueError, match="logged with reduction 'max' before, now 'mean'"):
        user.log("acc", 0.5)
    user.close(3, sent=True)
    with pytest.raises(ValueError, match="step 3 has closed"):
        user.log("acc", 0.5, "max", step=3)


def test_names_past_the_bound_are_dropped_and_counted(caplog):
    user = UserLog(rank=0, max_names=3)
    with caplog.at_level(logging.WARNING):
        for i in range(6):
            user.log(f"m{i}", float(i))
        user.log("m0", 10.0)  # a known name is still kept
    assert user.dropped == 3 and len(caplog.records) == 1  # one warning, every drop counted
    sent = user.close(0, sent=True)
    assert {p.labels[0][1]: p.value for p in sent if p.name == User.MEAN} == {
        "m0": 10.0,
        "m1": 1.0,
        "m2": 2.0,
    }


def test_values_held_for_future_steps_are_bounded_too():
    user = UserLog(rank=0, max_names=2)
    for step in range(20):
        user.log("a", 1.0, step=step + 100)
    assert user.dropped == 12 and len(user.close(200, sent=True)) == 2  # 8 held: newest kept


def test_points_carry_the_reduction_and_rank0_sends_from_rank_0_only():
    labels = ((Label.NAME, "acc"),)
    assert points("acc", 0.5, "mean", 3) == [
        Point(User.MEAN, 0.5, labels),
        Point(User.RANKS, 1.0, labels),
    ]
    assert points("acc", 0.5, "sum", 1) == [Point(User.SUM, 0.5, labels)]
    assert points("acc", 0.5, "max", 1) == [Point(User.MAX, 0.5, labels)]
    assert points("acc", 0.5, "rank0", 0) == [Point(User.FIRST, 0.5, labels)]
    assert points("acc", 0.5, "rank0", 1) == []


def test_a_value_goes_with_its_step_or_the_next_step_sent():
    user = UserLog(rank=0)
    user.log("a", 1.0, step=5)  # for step 5
    user.log("b", 2.0)  # for the next step sent
    assert [p.value for p in user.close(2, sent=False)] == []  # not sent: values kept
    got = user.close(3, sent=True)
    assert [(p.labels[0][1], p.value) for p in got if p.name == User.MEAN] == [("b", 2.0)]
    user.log("a", 3.0)  # the newest value of a name wins
    got = user.close(5, sent=True)
    assert [p.value for p in got if p.name == User.MEAN] == [3.0]
    assert user.close(6, sent=True) == []


def test_monitor_sends_logged_values_on_their_steps_and_keeps_nonfinite():
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(seq_len=8, d_model=16, n_layer=1, n_head=2))
    transport = MemoryTransport()
    identity = RankIdentity(run_id="u", rank=0, world_size=1, coords={"dp": 0})
    config = ProbeConfig(telemetry=False, comm=False)
    monitor = attach(model, None, identity=identity, config=config, transport=transport)
    monitor.log("before", 7.0)  # no step open: the next step
    for step in range(3):
        with monitor.step(step) as s:
            s.log("val_acc", 0.25 * step, reduction="rank0")
            s.log("loader_wait", math.nan if step == 2 else 0.5, reduction="max")
    monitor.log("late", 1.5, step=2 + 1)
    with pytest.raises(ValueError, match="step 2 has closed"):
        monitor.log("late", 1.0, step=2)
    assert monitor.stats["user_dropped"] == 0
    monitor.close()
    got = {}
    for key, value in transport.messages:
        record = decode_rank_step(key, value)
        for (name, labels), v in record.values.items():
            if name.startswith("user."):
                got[(record.step, name, dict(labels)[Label.NAME])] = v
    assert got[(0, User.MEAN, "before")] == 7.0 and got[(0, User.RANKS, "before")] == 1.0
    assert [got[(s, User.FIRST, "val_acc")] for s in range(3)] == [0.0, 0.25, 0.5]
    assert got[(1, User.MAX, "loader_wait")] == 0.5 and math.isnan(
        got[(2, User.MAX, "loader_wait")]
    )
    assert not any(k[2] == "late" for k in got)  # step 3 never ran: nothing sent for it


def test_null_monitor_checks_the_same_and_sends_nothing():
    monitor = NullMonitor()
    monitor.log("ok", 1.0)
    with monitor.step(0) as s:
        s.log("ok", 1.0)
        with pytest.raises(ValueError, match="user metric name 'bad name'"):
            s.log("bad name", 1.0)


def test_a_replayed_step_checks_its_log_calls_and_sends_nothing_again():
    """The loop's code runs again in ``Monitor.replay``: its ``s.log`` is not an error (the
    step closed) and sends nothing; the step's own value went with the step."""
    torch.manual_seed(0)
    model = TinyLM(TinyConfig(seq_len=8, d_model=16, n_layer=1, n_head=2))
    transport = MemoryTransport()
    identity = RankIdentity(run_id="u", rank=0, world_size=1, coords={"dp": 0})
    config = ProbeConfig(telemetry=False, comm=False, replay_steps=2)
    monitor = attach(model, None, identity=identity, config=config, transport=transport)
    tokens = torch.randint(0, 256, (2, 8))

    def step_body(s, value):
        s.micro_batch(tokens=tokens, mask=torch.ones_like(tokens, dtype=torch.bool))
        losses = model(tokens).float().logsumexp(-1)
        s.loss(losses)
        losses.sum().backward()
        s.gradients()
        s.log("val_acc", value)

    with monitor.step(0) as s:
        step_body(s, 0.25)
    with monitor.replay(0) as s:
        step_body(s, 0.75)
        with pytest.raises(ValueError, match="user metric name"):
            s.log("bad name", 1.0)
    monitor.close()
    sent = [
        (r.step, r.replay, v)
        for r in (decode_rank_step(k, m) for k, m in transport.messages)
        for (name, _), v in r.values.items()
        if name == User.MEAN
    ]
    assert sent == [(0, False, 0.25)]
