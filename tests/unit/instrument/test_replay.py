"""Replay under dense probes with a verdict (``Monitor.replay``): a step re-run on its own
batch with the parameters unchanged reproduces bit for bit ("data"); a replay whose weights
moved (what a flaky device does) does not ("hardware"). The verdict is counted in the
guard's counters of the next emitted step; the replay's scan-tier detail goes out once,
marked replay, when the step did not send its own."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from probewire.deploy.demo.data import SOURCES, load_corpus
from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.catalog import CATALOG, Grad, Guard, Loss, Tensor, Tier
from probewire.instrument.replay import DATA, HARDWARE, Totals, judge
from probewire.instrument.wire import decode_rank_step

IDENTITY = RankIdentity(run_id="replay", rank=0, world_size=1, host="h")


def _batches(n: int):
    corpus, rng, cfg = load_corpus(), np.random.default_rng(1), TinyConfig()
    return [corpus.batch(rng, 4, cfg.seq_len, min_len=8) for _ in range(n)]


def _monitor(scan_every: int = 100, **config):
    torch.manual_seed(0)
    model = TinyLM(TinyConfig())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    transport = MemoryTransport()
    cfg = ProbeConfig(
        cadence={"step": 1, "scan": scan_every}, clip_threshold=1.0, sources=SOURCES, **config
    )
    return (
        model,
        opt,
        attach(model, opt, identity=IDENTITY, config=cfg, transport=transport),
        transport,
    )


def _forward_backward(s, model, batch) -> torch.Tensor:
    s.micro_batch(tokens=batch.tokens, mask=batch.targets != IGNORE, source=batch.source)
    logits = model(batch.tokens)
    losses = F.cross_entropy(
        logits.transpose(1, 2), batch.targets, ignore_index=IGNORE, reduction="none"
    )
    s.loss(losses)
    (losses.sum() / (batch.targets != IGNORE).sum()).backward()
    s.gradients()
    return logits.detach()


def _run(model, opt, monitor, batches, update: bool = True) -> list[torch.Tensor]:
    """Train on ``batches``; the last step's update is skipped (the guard's case) when
    ``update`` is False. Returns each step's logits."""
    out = []
    for step, batch in enumerate(batches):
        with monitor.step(step) as s:
            out.append(_forward_backward(s, model, batch))
            if update or step < len(batches) - 1:
                opt.step()
                opt.zero_grad()
            else:
                s.skipped()
    return out


def _messages(monitor, transport):
    assert monitor._emitter.flush(30)
    return [decode_rank_step(k, v) for k, v in transport.messages]


def _nll_sum_f64(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Σ over valid targets of −log softmax, in float64 NumPy from the model's logits."""
    z = logits.double().numpy().reshape(-1, logits.shape[-1])
    t = targets.numpy().reshape(-1)
    valid = t != IGNORE
    z, t = z[valid], t[valid]
    top = z.max(axis=1, keepdims=True)
    lse = top[:, 0] + np.log(np.exp(z - top).sum(axis=1))
    return float(np.sum(lse - z[np.arange(len(t)), t]))


def _flip_exponent_bit(weight: torch.Tensor) -> None:
    """What a flaky device does to a replay: one weight halves or doubles."""
    with torch.no_grad():
        weight.data[32, 0:1].view(torch.int32).bitwise_xor_(1 << 23)


def test_a_deterministic_replay_reproduces_bit_for_bit_and_says_data():
    batches = _batches(3)
    model, opt, monitor, transport = _monitor()
    logits = _run(model, opt, monitor, batches, update=False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    replay = monitor.replay(2)
    with replay as s:
        assert s.step == 2 and s.sampled("scan") and not s.sampled("demand")
        _forward_backward(s, model, batches[2])
    v = replay.verdict
    assert v.verdict == DATA and v.reproduced and v.rtol == 0.0 and v.step == 2
    assert v.replayed == v.original  # bit-exact: loss sum, tokens and gradient norm
    # what the step kept is its loss sum and token count (float64 reference) and G
    targets = batches[2].targets
    assert v.original.tokens == int((targets != IGNORE).sum())
    assert math.isclose(v.original.loss_sum, _nll_sum_f64(logits[2], targets), rel_tol=1e-5)
    norm = float(np.sqrt(sum(np.sum(g.double().numpy() ** 2) for g in grads.values())))
    assert math.isclose(v.original.grad_norm, norm, rel_tol=1e-5)
    # the replay's gradients were dropped: the step's own are back, unchanged
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.equal(p.grad, grads[n])
    with monitor.step(3) as s:  # the verdict goes out with the next emitted step
        _forward_backward(s, model, batches[0])
    sent = _messages(monitor, transport)
    monitor.close()
    after = next(r for r in sent if r.step == 3 and not r.replay)
    assert after.values[(Guard.REPLAYED, ())] == 1.0
    assert after.values[(Guard.REPLAY_MISMATCH, ())] == 0.0
    step2 = next(r for r in sent if r.step == 2 and not r.replay)
    assert step2.values[(Guard.SKIPPED, ())] == 1.0
    assert step2.values[(Guard.REPLAYED, ())] == 0.0


def test_a_replay_whose_weights_moved_does_not_reproduce_and_says_hardware():
    batches = _batches(2)
    model, opt, monitor, transport = _monitor()
    _run(model, opt, monitor, batches, update=False)
    weight = model.head.weight
    saved = weight.detach().clone()
    replay = monitor.replay(1)
    with replay as s:
        _flip_exponent_bit(weight)
        _forward_backward(s, model, batches[1])
        weight.data.copy_(saved)
    v = replay.verdict
    assert v.verdict == HARDWARE and not v.reproduced
    assert v.replayed.tokens == v.original.tokens
    assert v.replayed.loss_sum != v.original.loss_sum
    with monitor.step(2) as s:
        _forward_backward(s, model, batches[0])
    sent = _messages(monitor, transport)
    monitor.close()
    after = next(r for r in sent if r.step == 2 and not r.replay)
    assert after.values[(Guard.REPLAYED, ())] == 1.0
    assert after.values[(Guard.REPLAY_MISMATCH, ())] == 1.0


def test_the_replay_sends_its_scan_detail_once_marked_replay_unless_the_step_sent_its_own():
    batches = _batches(2)
    model, opt, monitor, transport = _monitor(scan_every=100)  # step 1 is not a scan step
    _run(model, opt, monitor, batches, update=False)
    with monitor.replay(1) as s:
        _forward_backward(s, model, batches[1])
    with monitor.replay(0) as s:  # step 0 scanned (0 % 100 == 0): nothing more is sent
        _forward_backward(s, model, batches[0])
    sent = _messages(monitor, transport)
    monitor.close()
    replays = [r for r in sent if r.replay]
    assert [r.step for r in replays] == [1]
    names = {k[0] for k in replays[0].values}
    assert Tensor.ABS_MAX in names and Loss.SUM not in names and Grad.NORM_SQ not in names
    assert all(CATALOG[name].tier is Tier.SCAN for name in names)
    step1 = next(r for r in sent if r.step == 1 and not r.replay)
    assert not any(CATALOG[k[0]].tier is Tier.SCAN for k in step1.values)


def test_replay_refuses_what_it_cannot_judge():
    batches = _batches(3)
    model, opt, monitor, _ = _monitor(replay_steps=2)
    _run(model, opt, monitor, batches)
    with pytest.raises(ValueError, match=r"replay of step 0: not kept .*kept: 1, 2"):
        monitor.replay(0)
    with pytest.raises(ValueError, match="rtol must be >= 0"):
        monitor.replay(2, rtol=-1.0)
    with monitor.step(3) as s:
        with pytest.raises(RuntimeError, match="replay a step after its step context closed"):
            monitor.replay(2)
        _forward_backward(s, model, batches[0])
    with pytest.raises(ValueError, match="valid tokens, the step had"):
        with monitor.replay(3) as s:  # another batch: the caller's mistake
            _forward_backward(s, model, batches[1])
    with pytest.raises(ValueError, match="no loss recorded"):
        with monitor.replay(3):
            pass
    monitor.close()


def test_replay_off_and_disabled_monitor():
    batches = _batches(1)
    model, opt, monitor, _ = _monitor(replay_steps=0)
    _run(model, opt, monitor, batches)
    with pytest.raises(ValueError, match="replay_steps=0"):
        monitor.replay(0)
    monitor.close()
    null = attach(model, opt, config=ProbeConfig(enabled=False))
    replay = null.replay(0)
    with replay as s:
        s.loss(torch.zeros(2))
    assert replay.verdict is None
    with pytest.raises(ValueError, match="ProbeConfig.replay_steps"):
        ProbeConfig(replay_steps=-1)


@pytest.mark.parametrize(
    "original, replayed, rtol, verdict",
    [
        ((10.0, 5.0, 2.0), (10.0, 5.0, 2.0), 0.0, DATA),
        ((10.0, 5.0, 2.0), (10.0 + 1e-12, 5.0, 2.0), 0.0, HARDWARE),  # bit-exact by default
        ((10.0, 5.0, 2.0), (10.0 + 1e-12, 5.0, 2.0), 1e-9, DATA),
        ((10.0, 5.0, 2.0), (10.0, 5.0, 2.5), 1e-9, HARDWARE),  # the gradient norm moved
        ((10.0, 5.0, None), (10.0, 5.0, 2.5), 0.0, DATA),  # no G kept: loss only
        ((math.nan, 5.0, 2.0), (math.nan, 5.0, 2.0), 0.0, DATA),  # the batch makes NaN again
        ((math.nan, 5.0, 2.0), (10.0, 5.0, 2.0), 0.0, HARDWARE),
        ((10.0, 5.0, math.inf), (10.0, 5.0, math.inf), 0.0, DATA),
    ],
)
def test_judge(original, replayed, rtol, verdict):
    assert judge(7, Totals(*original), Totals(*replayed), rtol).verdict == verdict
