"""attach() on a real model in one process: every step value against a float64 reference,
gating (no tensor work on an unsampled step), recomputation, scaling, the null monitor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, NullMonitor, ProbeConfig, RankIdentity, attach
from probewire.instrument.wire import decode_rank_step

SOURCES = ("web", "code")
CFG = TinyConfig(seq_len=8, d_model=16, n_layer=2, n_head=2)
QUIET = dict(telemetry=False, comm=False)


def identity(rank: int = 0, world: int = 1, **coords: int) -> RankIdentity:
    return RankIdentity(run_id="t", rank=rank, world_size=world, coords=coords or {"dp": rank})


def make_batches(seed: int, rows=(3, 2)):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in rows:  # uneven micro-batches, padded rows
        tokens = torch.randint(0, 256, (n, CFG.seq_len), generator=g)
        targets = torch.randint(0, 256, (n, CFG.seq_len), generator=g)
        lengths = torch.randint(1, CFG.seq_len + 1, (n,), generator=g)
        targets[torch.arange(CFG.seq_len)[None, :] >= lengths[:, None]] = IGNORE
        out.append((tokens, targets, torch.randint(0, 2, (n,), generator=g)))
    return out


def token_losses(logits, targets):
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="none",
    ).view_as(targets)


def train_step(monitor, model, opt, step, batches, clip=1.0, scaler=None):
    n_valid = sum(int((t != IGNORE).sum()) for _, t, _ in batches)
    with monitor.step(step) as s:
        for tokens, targets, source in batches:
            s.micro_batch(tokens=tokens, mask=targets != IGNORE, source=source)
            losses = token_losses(model(tokens), targets)
            s.loss(losses)
            loss = losses.sum() / max(n_valid, 1)
            (scaler.scale(loss) if scaler else loss).backward()
        s.gradients(scaler=scaler)
        if scaler:
            scaler.unscale_(opt)
        s.clipped(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        (scaler.step(opt), scaler.update()) if scaler else opt.step()
        opt.zero_grad(set_to_none=True)


def run(config, steps=1, seed=0, model=None, batches=None, **kwargs):
    torch.manual_seed(seed)
    model = model or TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    transport = MemoryTransport()
    monitor = attach(model, opt, identity=identity(), config=config, transport=transport)
    for step in range(steps):
        train_step(monitor, model, opt, step, batches or make_batches(seed + step), **kwargs)
    monitor.close()
    return [decode_rank_step(k, v) for k, v in transport.messages], model


def value(record, name, **labels):
    return record.values[(name, tuple(sorted(labels.items())))]


def test_p0_step_values_match_a_float64_reference():
    batches = make_batches(7)
    torch.manual_seed(0)
    ref_model = TinyLM(CFG)
    n_valid = sum(int((t != IGNORE).sum()) for _, t, _ in batches)
    ref = {"sum": 0.0, "src": np.zeros((2, 2)), "absmax": 0.0, "sumsq": 0.0, "n": 0}
    for tokens, targets, source in batches:
        logits = ref_model(tokens)
        losses = token_losses(logits, targets)
        (losses.sum() / n_valid).backward()
        mask = (targets != IGNORE).numpy()
        l64 = losses.detach().double().numpy() * mask
        ref["sum"] += l64.sum()
        for r, s in enumerate(source.tolist()):
            ref["src"][s] += (l64[r].sum(), mask[r].sum())
        z = logits.detach().double().numpy()[mask]
        ref["absmax"] = max(ref["absmax"], np.abs(z).max())
        ref["sumsq"] += (z * z).sum()
        ref["n"] += z.size
    g2 = sum(float((p.grad.double() ** 2).sum()) for p in ref_model.parameters())

    [rec], model = run(ProbeConfig(clip_threshold=1.0, sources=SOURCES, **QUIET), batches=batches)
    assert value(rec, "loss.sum") == pytest.approx(ref["sum"], rel=1e-9)
    assert value(rec, "loss.tokens") == n_valid
    for i, name in enumerate(SOURCES):
        assert value(rec, "loss.sum", source=name) == pytest.approx(ref["src"][i, 0], rel=1e-9)
        assert value(rec, "loss.tokens", source=name) == ref["src"][i, 1]
    assert value(rec, "grad.norm_sq") == pytest.approx(g2, rel=1e-5)
    assert value(rec, "grad.clipped") == float(math.sqrt(g2) > 1.0)
    assert value(rec, "output.logits_abs_max") == pytest.approx(ref["absmax"], rel=1e-6)
    assert value(rec, "output.logits_sum_sq") == pytest.approx(ref["sumsq"], rel=1e-5)
    assert value(rec, "output.logits_n") == ref["n"]
    positions = sum(t.numel() for t, _, _ in batches)
    assert value(rec, "tokens.positions") == positions
    assert value(rec, "flops.step") == pytest.approx(model.flops_per_token() * positions)
    assert value(rec, "step.duration") > 0 and value(rec, "memory.peak_rss") > 0
    assert value(rec, "guard.skipped") == 0


def test_p1_gradient_detail_and_update_ratio_components():
    batches = make_batches(3)
    torch.manual_seed(0)
    before = {n: p.detach().clone() for n, p in TinyLM(CFG).named_parameters()}
    recs, model = run(ProbeConfig(cadence={"scan": 1}, **QUIET), batches=batches)
    rec = recs[0]
    after = dict(model.named_parameters())
    for name in ("blocks.0.mlp.up.weight", "embed.weight"):
        w, delta = before[name].double(), after[name].detach().double() - before[name].double()
        assert value(rec, "tensor.n", tensor=name, kind="param") == w.numel()
        assert value(rec, "tensor.sum_sq", tensor=name, kind="param") == pytest.approx(
            float((w * w).sum()), rel=1e-6
        )
        assert value(rec, "tensor.sum_sq", tensor=name, kind="update") == pytest.approx(
            float((delta * delta).sum()), rel=1e-4
        )
    # group detail: the embedding rows of absent bytes get exactly zero gradient
    assert value(rec, "grad.zeros", group="embedding") > 0
    assert value(rec, "grad.elements") == sum(p.numel() for p in model.parameters())
    assert value(rec, "grad.norm_sq", group="embedding") + value(
        rec, "grad.norm_sq", group="other"
    ) == pytest.approx(value(rec, "grad.norm_sq"), rel=1e-5)
    kinds = {dict(labels)["kind"] for (name, labels) in rec.values if name == "tensor.n"}
    assert kinds == {"fwd", "bwd", "grad", "param", "update"}  # P2 chain is off


def test_p2_adds_kurtosis_moments_and_the_adamw_chain():
    [rec], _ = run(ProbeConfig(cadence={"scan": 1, "demand": 1}, **QUIET))
    kinds = {dict(labels)["kind"] for (name, labels) in rec.values if name == "tensor.sum4"}
    assert {"opt_grad", "opt_normalized", "opt_direction", "fwd"} <= kinds


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def count_step_ops(monitor, step):
    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = monitor(model, opt)
    batches = make_batches(11)
    with CountOps() as counter:
        train_step(mon, model, opt, step, batches)
    mon.close()
    return counter.ops


@pytest.mark.parametrize("persistent", [False, True])
def test_an_unsampled_step_runs_no_probe_tensor_op(persistent):
    config = ProbeConfig(
        cadence={"step": 2, "scan": 4},
        clip_threshold=1.0,
        sources=SOURCES,
        persistent_hooks=persistent,
        **QUIET,
    )

    def attached(model, opt):
        return attach(model, opt, identity=identity(), config=config, transport=MemoryTransport())

    def detached(model, opt):
        return NullMonitor()

    baseline = count_step_ops(detached, 1)
    assert count_step_ops(attached, 1) == baseline  # step 1: nothing sampled
    assert len(count_step_ops(attached, 4)) > len(baseline) + 100  # step 4: P0 + P1 ran


class Checkpointed(TinyLM):
    reentrant: bool | None = None

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = (
                checkpoint(block, x, use_reentrant=self.reentrant)
                if self.reentrant is not None
                else block(x)
            )
        return self.head(self.ln_f(x))


def tensor_stats(recs):
    return {
        (dict(labels)["tensor"], dict(labels)["kind"], n): v
        for (n, labels), v in recs[0].values.items()
        if n.startswith("tensor.") and dict(labels)["kind"] in ("fwd", "bwd")
    }


@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_does_not_count_a_probe_twice(reentrant):
    config = ProbeConfig(cadence={"scan": 1}, **QUIET)
    torch.manual_seed(0)
    plain = Checkpointed(CFG)
    plain_recs, _ = run(config, model=plain, batches=make_batches(5))
    torch.manual_seed(0)
    ckpt = Checkpointed(CFG)
    ckpt.reentrant = reentrant
    ckpt_recs, _ = run(config, model=ckpt, batches=make_batches(5))
    plain_stats, ckpt_stats = tensor_stats(plain_recs), tensor_stats(ckpt_recs)
    assert ("blocks.0.attn", "bwd", "tensor.n") in ckpt_stats
    assert set(ckpt_stats) == set(plain_stats)
    for key, v in plain_stats.items():
        assert ckpt_stats[key] == pytest.approx(v, rel=1e-5, abs=1e-9), key


def test_grad_scaler_scale_is_removed_before_and_not_after_unscale():
    batches = make_batches(9)
    [plain], _ = run(ProbeConfig(**QUIET), batches=batches)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    [scaled], _ = run(ProbeConfig(**QUIET), batches=batches, scaler=scaler)
    assert value(scaled, "grad.norm_sq") == pytest.approx(value(plain, "grad.norm_sq"), rel=1e-5)


def test_guard_counters_and_densify():
    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters())
    transport = MemoryTransport()
    monitor = attach(
        model,
        opt,
        identity=identity(),
        transport=transport,
        config=ProbeConfig(cadence={"scan": 0}, **QUIET),
    )
    with monitor.step(0) as s:
        s.skipped()
        s.replayed(reproduced=True)
        s.replayed(reproduced=False)
    monitor.densify(2)
    for step in (1, 2, 3):
        train_step(monitor, model, opt, step, make_batches(step))
    monitor.close()
    recs = {r.step: r for r in (decode_rank_step(k, v) for k, v in transport.messages)}
    assert (
        value(recs[0], "guard.skipped"),
        value(recs[0], "guard.replayed"),
        value(recs[0], "guard.replay_mismatch"),
    ) == (1, 2, 1)
    assert value(recs[1], "guard.skipped") == 0
    has_tensors = {s: any(n == "tensor.n" for n, _ in r.values) for s, r in recs.items()}
    assert has_tensors == {0: False, 1: True, 2: True, 3: False}
    # P2 forensics (kurtosis moments) stay on demand: densify does not switch them on
    assert not any(n == "tensor.sum3" for r in recs.values() for n, _ in r.values)


def test_disabled_monitor_is_a_null_object_with_the_same_api():
    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters())
    transport = MemoryTransport()
    monitor = attach(
        model, opt, identity=identity(), transport=transport, config=ProbeConfig(enabled=False)
    )
    assert isinstance(monitor, NullMonitor)
    train_step(monitor, model, opt, 0, make_batches(0))
    assert monitor.checkpoint("/x", 0, 1, 1.0) is False
    assert not any(m._forward_hooks for m in model.modules())
    monitor.close()
    assert transport.messages == []


def test_close_removes_every_hook():
    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters())
    monitor = attach(
        model,
        opt,
        identity=identity(),
        transport=MemoryTransport(),
        config=ProbeConfig(persistent_hooks=True, **QUIET),
    )
    assert any(m._forward_hooks for m in model.modules())
    monitor.close()
    assert not any(m._forward_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_checkpoint_event_is_published_by_rank_0_only():
    import json

    model = TinyLM(CFG)
    events = [MemoryTransport(), MemoryTransport()]
    for rank, transport in enumerate(events):
        mon = attach(
            model,
            None,
            identity=identity(rank, 2),
            transport=MemoryTransport(),
            events=transport,
            config=ProbeConfig(**QUIET),
        )
        mon.checkpoint("/ckpt/step10.pt", 10, 5000, 1.5e12, weights_stream="ema", key=True)
        mon.close()
    [(key, body)] = events[0].messages
    assert key == b"t" and events[1].messages == []
    assert json.loads(body) == {
        "run_id": "t",
        "step": 10,
        "tokens": 5000,
        "flops": 1.5e12,
        "path": "/ckpt/step10.pt",
        "weights_stream": "ema",
        "key": True,
    }
    with pytest.raises(ValueError, match="weights_stream"):
        attach(
            model,
            None,
            identity=identity(),
            transport=MemoryTransport(),
            config=ProbeConfig(**QUIET),
        ).checkpoint("/x", 1, 1, 1.0, weights_stream="avg")


def test_clip_grad_norm_helper_measures_before_clipping_and_clips_like_torch():
    batches = make_batches(13)
    torch.manual_seed(0)
    reference = TinyLM(CFG)
    n_valid = sum(int((t != IGNORE).sum()) for _, t, _ in batches)
    for tokens, targets, _ in batches:
        (token_losses(reference(tokens), targets).sum() / n_valid).backward()
    pre_clip = [p.grad.detach().clone() for p in reference.parameters()]
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    expected_grads = [p.grad.clone() for p in reference.parameters()]

    torch.manual_seed(0)
    model = TinyLM(CFG)
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=identity(),
        transport=transport,
        config=ProbeConfig(cadence={"scan": 1}, clip_threshold=0.5, **QUIET),
    )
    with monitor.step(0) as s:
        for tokens, targets, source in batches:
            s.micro_batch(tokens=tokens, mask=targets != IGNORE, source=source)
            (token_losses(model(tokens), targets).sum() / n_valid).backward()
        norm = s.clip_grad_norm_(model.parameters(), 0.5)
    monitor.close()
    [rec] = [decode_rank_step(k, v) for k, v in transport.messages]
    assert float(norm) == float(expected_norm)
    assert math.sqrt(value(rec, "grad.norm_sq")) == float(expected_norm)  # exactly the norm
    assert value(rec, "grad.clipped") == 1.0 and float(expected_norm) > 0.5
    for p, g in zip(model.parameters(), expected_grads):
        assert torch.equal(p.grad, g)  # clipped as torch clips
    embed_grad = pre_clip[0].double()
    assert value(rec, "tensor.sum_sq", tensor="embed.weight", kind="grad") == pytest.approx(
        float((embed_grad**2).sum()), rel=1e-6
    )  # the scans saw the unclipped gradient


def test_every_step_gradient_groups_are_the_unclipped_gradient_reduced_after_the_clip():
    """P0 only, on CPU: the group statistics are reduced on the emitter thread, after
    ``clip_grad_norm_`` scaled the gradients in place; they are the copies taken before it."""
    batches = make_batches(5)
    torch.manual_seed(0)
    model = TinyLM(CFG)
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=identity(),
        transport=transport,
        config=ProbeConfig(cadence={"step": 1, "scan": 0, "demand": 0}, **QUIET),
    )
    n_valid = sum(int((t != IGNORE).sum()) for _, t, _ in batches)
    with monitor.step(0) as s:
        for tokens, targets, _ in batches:
            s.micro_batch(tokens=tokens, mask=targets != IGNORE)
            (token_losses(model(tokens), targets).sum() / n_valid).backward()
        pre_clip = {n: p.grad.double().numpy().copy() for n, p in model.named_parameters()}
        norm = float(s.clip_grad_norm_(model.parameters(), 1e-3))
    monitor.close()
    assert norm > 1e-2  # the clip scaled every gradient by less than 1/10
    [rec] = [decode_rank_step(k, v) for k, v in transport.messages]
    for name, want in group_reference(pre_clip, list(pre_clip)).items():
        assert value(rec, name) == pytest.approx(want, rel=1e-5), name
    assert math.sqrt(value(rec, "grad.norm_sq")) == norm


class Branches(torch.nn.Module):
    """Two heads on a shared trunk; a step uses one or both, so gradients come and go."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.trunk = torch.nn.Linear(8, 8)
        self.left, self.right = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, tokens, heads):
        x = self.trunk(self.embed(tokens))
        return sum(getattr(self, h)(x).pow(2).mean() for h in heads)


@pytest.mark.parametrize("order", ["model", "reversed", "subset"])
def test_gradients_that_come_and_go_are_measured_each_step_as_present(order):
    """P0, ``clip_grad_norm_`` every step, gradients set to None between steps: a head
    unused on a step has no gradient then. Each step's group statistics are those of the
    gradients present (float64 reference, before the clip); G2 is the norm of every
    gradient present whether the clip was given the parameters in the model's order, in
    another order or a subset; the gradients are clipped as torch clips them."""
    torch.manual_seed(0)
    model = Branches()
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=identity(),
        transport=transport,
        config=ProbeConfig(
            cadence={"step": 1, "scan": 0, "demand": 0}, clip_threshold=0.05, **QUIET
        ),
    )
    heads = [("left",), ("left", "right"), ("right",), ("left",), ("left", "right")]
    params = dict(model.named_parameters())
    given = {
        "model": list(params),
        "reversed": list(params)[::-1],
        "subset": [n for n in params if not n.startswith("right")],
    }[order]
    seen = []
    for step, used in enumerate(heads):
        tokens = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
        with monitor.step(step) as s:
            model(tokens, used).backward()
            seen.append(
                {n: p.grad.double().numpy().copy() for n, p in params.items() if p.grad is not None}
            )
            copies = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
            for n, copy in copies.items():
                copy.grad = None if params[n].grad is None else params[n].grad.clone()
            torch.nn.utils.clip_grad_norm_([copies[n] for n in given], 0.05)
            s.clip_grad_norm_([params[n] for n in given], 0.05)
        for n, p in params.items():
            assert p.grad is None or torch.equal(p.grad, copies[n].grad), (step, n)
        model.zero_grad(set_to_none=True)
    monitor.close()
    records = [decode_rank_step(k, v) for k, v in transport.messages]
    assert [r.step for r in records] == list(range(len(heads)))
    for rec, grads, used in zip(records, seen, heads):
        assert {n.split(".")[0] for n in grads} == {"embed", "trunk", *used}
        for name, want in group_reference(grads, list(grads)).items():
            assert value(rec, name) == pytest.approx(want, rel=1e-6), (rec.step, name)
        embedding = [n for n in grads if n.startswith("embed")]
        for name, want in group_reference(grads, embedding).items():
            assert value(rec, name, group="embedding") == pytest.approx(want, rel=1e-6)


def test_fused_loss_totals_and_a_stage_without_the_loss():
    torch.manual_seed(0)
    model = TinyLM(CFG)
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=identity(),
        transport=transport,
        config=ProbeConfig(sources=SOURCES, **QUIET),
    )
    tokens, targets, _ = make_batches(2)[0]
    with monitor.step(0) as s:  # a fused loss that only returns its sum and count
        loss_sum = token_losses(model(tokens), targets).sum()
        s.loss_totals(loss_sum, int((targets != IGNORE).sum()))
        s.loss_totals(torch.tensor(1.5), 3)
    with monitor.step(1) as s:  # e.g. a pipeline stage that never sees the loss
        s.micro_batch(tokens=tokens)
        model(tokens)
    monitor.close()
    first, second = (decode_rank_step(k, v) for k, v in transport.messages)
    assert value(first, "loss.sum") == pytest.approx(float(loss_sum.detach()) + 1.5, rel=1e-6)
    assert value(first, "loss.tokens") == int((targets != IGNORE).sum()) + 3
    assert not any(labels for name, labels in first.values if name == "loss.sum")
    assert not any(name.startswith("loss.") for name, _ in second.values)
    assert value(second, "tokens.positions") == tokens.numel()


def test_an_extension_shares_the_step_and_is_told_its_boundaries():
    calls = []

    class Extension:
        def on_gradients(self, state, inv_scale):
            calls.append(("on_gradients", inv_scale))

        def finish(self, state):
            calls.append(("finish",))

        def remove(self):
            calls.append(("remove",))

    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters())
    monitor = attach(
        model,
        opt,
        identity=identity(),
        transport=MemoryTransport(),
        config=ProbeConfig(cadence={"step": 2}, **QUIET),
    )
    monitor.add_extension(Extension())
    for step in (0, 1):
        train_step(monitor, model, opt, step, make_batches(step))
    monitor.close()
    assert calls == [("on_gradients", None), ("finish",), ("remove",)]  # step 1 unsampled


def group_reference(grads: dict[str, np.ndarray], names) -> dict[str, float]:
    """float64 per-group gradient statistics: finite sums and maximum, counts."""
    a = np.concatenate([grads[n].ravel() for n in names])
    f = a[np.isfinite(a)]
    return {
        "grad.abs_sum": np.abs(f).sum(),
        "grad.abs_max": np.abs(f).max(initial=0.0),
        "grad.zeros": np.count_nonzero(a == 0),
        "grad.elements": a.size,
        "grad.nonfinite": np.count_nonzero(~np.isfinite(a)),
        "grad.norm_sq": (f * f).sum(),
    }


@pytest.mark.parametrize("small, stack", [(None, None), (500, 40)])
def test_every_step_gradient_groups_match_a_float64_reference(monkeypatch, small, stack):
    """P0 only (no scan step): each group's small gradients are scanned as concatenations
    (split into several blocks, and larger tensors scanned alone, in the second case); with
    non-finite elements and a loss scale the per-group values equal the float64 reference."""
    from probewire.instrument import batchscan

    if small is not None:
        monkeypatch.setattr(batchscan, "SMALL_ELEMS", small)
        monkeypatch.setattr(batchscan, "STACK_ELEMS", stack)
    torch.manual_seed(0)
    model = TinyLM(CFG)
    transport = MemoryTransport()
    monitor = attach(
        model,
        None,
        identity=identity(),
        transport=transport,
        config=ProbeConfig(cadence={"step": 1, "scan": 0, "demand": 0}, **QUIET),
    )
    scale = 1024.0
    poisoned = dict(model.named_parameters())["blocks.1.mlp.up.weight"]
    poisoned.register_hook(
        lambda g: g.index_fill(0, torch.tensor([1]), float("nan")).index_fill(
            0, torch.tensor([3]), float("-inf")
        )
    )
    tokens, targets, _ = make_batches(3, rows=(2,))[0]
    with monitor.step(0) as s:
        s.micro_batch(tokens=tokens, mask=targets != IGNORE)
        losses = token_losses(model(tokens), targets)
        s.loss(losses)
        (losses.sum() * scale).backward()
        grads = {n: p.grad.double().numpy() / scale for n, p in model.named_parameters()}
        s.gradients(scale=scale)
    monitor.close()
    [rec] = [decode_rank_step(k, v) for k, v in transport.messages]
    embedding = [n for n in grads if n.startswith(("embed", "pos"))]
    other = [n for n in grads if n not in embedding]
    assert embedding and other
    for labels, names in (
        ({}, list(grads)),
        ({"group": "embedding"}, embedding),
        ({"group": "other"}, other),
    ):
        for name, want in group_reference(grads, names).items():
            if name == "grad.norm_sq" and not labels:
                assert math.isnan(value(rec, name))  # the clipping norm: NaN propagates
                continue
            assert value(rec, name, **labels) == pytest.approx(want, rel=1e-5), (name, labels)
    assert ("grad.abs_sum", (("group", "expert"),)) not in rec.values


def _clip_once(config, clip, max_norm):
    """One step on TinyLM clipped at ``max_norm``, by the helper (``clip`` "helper") or by
    torch with ``s.clipped(norm, max_norm=)`` ("torch"); the record and the norm."""
    batches = make_batches(13)
    torch.manual_seed(0)
    model = TinyLM(CFG)
    transport = MemoryTransport()
    monitor = attach(model, None, identity=identity(), transport=transport, config=config)
    n_valid = sum(int((t != IGNORE).sum()) for _, t, _ in batches)
    with monitor.step(0) as s:
        for tokens, targets, _ in batches:
            s.micro_batch(tokens=tokens, mask=targets != IGNORE)
            (token_losses(model(tokens), targets).sum() / n_valid).backward()
        if clip == "helper":
            norm = float(s.clip_grad_norm_(model.parameters(), max_norm))
        else:
            s.gradients()
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            s.clipped(total, max_norm=max_norm)
            norm = float(total)
    monitor.close()
    [rec] = [decode_rank_step(k, v) for k, v in transport.messages]
    return rec, norm


@pytest.mark.parametrize("clip", ["helper", "torch"])
@pytest.mark.parametrize("factor", [0.5, 2.0])  # max_norm under and over the step's G2
def test_clipped_uses_the_max_norm_the_loop_clipped_with_when_no_threshold_is_set(clip, factor):
    """No ProbeConfig.clip_threshold: grad.clipped = 1[G2 > max_norm] for the max_norm given
    to clip_grad_norm_ (or to clipped), and grad.clip_threshold = that max_norm."""
    _, g2 = _clip_once(ProbeConfig(**QUIET), clip, 1e9)
    rec, norm = _clip_once(ProbeConfig(**QUIET), clip, g2 * factor)
    assert norm == g2
    assert value(rec, "grad.clipped") == float(g2 > g2 * factor)
    assert value(rec, "grad.clip_threshold") == g2 * factor


def test_the_loops_max_norm_wins_over_a_different_clip_threshold_said_once(caplog):
    """ProbeConfig.clip_threshold = 1e9 but the loop clips at max_norm under G2: the loop's
    max_norm is what clipped, so grad.clipped = 1 and grad.clip_threshold = max_norm; the
    disagreement is logged once."""
    _, g2 = _clip_once(ProbeConfig(**QUIET), "helper", 1e9)
    with caplog.at_level("WARNING", logger="probewire.instrument.probes.grads"):
        rec, _ = _clip_once(ProbeConfig(clip_threshold=1e9, **QUIET), "helper", g2 / 2)
    assert value(rec, "grad.clipped") == 1.0 and value(rec, "grad.clip_threshold") == g2 / 2
    told = [r.getMessage() for r in caplog.records if "differs from the max_norm" in r.getMessage()]
    assert len(told) == 1 and "clip_threshold=1000000000.0" in told[0]


@pytest.mark.parametrize("update_inside", [True, False])
def test_a_grad_scaler_skip_is_a_skipped_step(update_inside):
    """A real torch.amp.GradScaler on CPU, an inf gradient forced on step 2 of 4: the scaler
    skips that optimizer step, and guard.skipped is 1 on exactly that step (0 on the others)
    whether ``scaler.update()`` runs inside the step (the scale backs off) or after it
    (found_inf still set); a loop's own ``s.skipped()`` on step 3 adds to it there."""
    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    transport = MemoryTransport()
    monitor = attach(
        model, opt, identity=identity(), transport=transport, config=ProbeConfig(**QUIET)
    )
    scales = []
    for step in range(4):
        batches = make_batches(step)
        n_valid = sum(int((t != IGNORE).sum()) for _, t, _ in batches)
        with monitor.step(step) as s:
            for tokens, targets, _ in batches:
                s.micro_batch(tokens=tokens, mask=targets != IGNORE)
                loss = token_losses(model(tokens), targets).sum() / n_valid
                scaler.scale(loss).backward()
            if step == 2:
                next(model.parameters()).grad.view(-1)[0] = math.inf
            s.gradients(scaler=scaler)
            scaler.unscale_(opt)
            s.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            if step == 3:
                s.skipped()  # the loop's spike guard, on a step the scaler took
            if update_inside:
                scaler.update()
        if not update_inside:
            scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad(set_to_none=True)
    monitor.close()
    recs = sorted((decode_rank_step(k, v) for k, v in transport.messages), key=lambda r: r.step)
    assert scales == [2.0**10, 2.0**10, 2.0**9, 2.0**9]  # the scaler skipped step 2 only
    assert [value(r, "guard.skipped") for r in recs] == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize("local_rank", [0, 1])
def test_each_nodes_local_rank_0_sends_the_network_counters(local_rank):
    """net.* is read once per node by the node's local rank 0, whatever its global rank
    (rank 5 of 8: the second node's first when local_rank is 0), and by no other rank."""
    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    transport = MemoryTransport()
    ident = RankIdentity(run_id="t", rank=5, world_size=8, local_rank=local_rank, coords={"dp": 5})
    monitor = attach(
        model, opt, identity=ident, config=ProbeConfig(comm=False), transport=transport
    )
    for step in range(2):
        train_step(monitor, model, opt, step, make_batches(step))
    monitor.close()
    records = [decode_rank_step(k, v) for k, v in transport.messages]
    sent = [{n for n, _ in r.values if n.startswith("net.")} for r in records]
    assert sent == [{"net.rx", "net.tx"} if local_rank == 0 else set()] * 2
    assert all(r.rank == 5 for r in records)


@pytest.mark.parametrize("clip", ["helper", "torch"])
def test_the_loops_own_clipping_norm_is_sent_for_the_audit_and_the_helpers_is_not(clip):
    """``s.clipped(total)`` with a norm the loop computed itself sends it as grad.clip_norm
    (the stream audits it against G2); through ``s.clip_grad_norm_`` the clipping norm is the
    measurement itself and nothing more is sent."""
    rec, norm = _clip_once(ProbeConfig(**QUIET), clip, 1e9)
    sent = value(rec, "grad.clip_norm") if clip == "torch" else None
    assert (
        ("grad.clip_norm", ()) in rec.values
        if clip == "torch"
        else (("grad.clip_norm", ()) not in rec.values)
    )
    if sent is not None:
        assert sent == norm and sent == pytest.approx(
            math.sqrt(value(rec, "grad.norm_sq")), rel=1e-6
        )
