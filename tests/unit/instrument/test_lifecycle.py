"""Rank identity from the launcher's environment, run lifecycle events, the learning-rate
probe, source names, and attach's one warning about what it found nothing to hook."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from probewire.deploy.demo.model import IGNORE, TinyConfig, TinyLM
from probewire.instrument import MemoryTransport, ProbeConfig, RankIdentity, attach
from probewire.instrument.catalog import Label, Loss, Optim
from probewire.instrument.lifecycle import MAX_CONFIG_BYTES, run_event
from probewire.instrument.wire import decode_rank_step

CFG = TinyConfig(seq_len=8, d_model=16, n_layer=2, n_head=2)
QUIET = dict(telemetry=False, comm=False)


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "PROBEWIRE_RUN_ID": "r9"},
            ("r9", 3, 4, 1),
        ),
        (
            {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "77"},
            ("slurm-77", 5, 8, 1),
        ),
        ({"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "abc"}, ("abc", 1, 2, 0)),
        ({"PROBEWIRE_RUN_ID": "solo"}, ("solo", 0, 1, 0)),
    ],
)
def test_identity_from_torchrun_slurm_or_a_single_process(env, expected):
    ident = RankIdentity.from_env(env=env)
    assert (ident.run_id, ident.rank, ident.world_size, ident.local_rank) == expected


def test_identity_without_a_shared_run_id_says_what_to_set():
    with pytest.raises(ValueError, match="PROBEWIRE_RUN_ID"):
        RankIdentity.from_env(env={"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"})
    assert RankIdentity.from_env("given", env={}).run_id == "given"


def test_run_config_must_be_a_bounded_mapping():
    ident = RankIdentity(run_id="r", rank=0, world_size=1)
    body = json.loads(run_event(ident, "started", config={"lr": 3e-4, "path": object()}))
    assert body["event"] == "started" and body["config"]["lr"] == 3e-4
    assert isinstance(body["config"]["path"], str)
    with pytest.raises(ValueError, match="limit"):
        run_event(ident, "started", config={"x": "a" * MAX_CONFIG_BYTES})
    with pytest.raises(ValueError, match="mapping"):
        run_event(ident, "started", config=[1, 2])  # type: ignore[arg-type]


def _model_and_opt():
    torch.manual_seed(0)
    model = TinyLM(CFG)
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "lr": 1e-3},
            {
                "params": [p for n, p in model.named_parameters() if not n.endswith("bias")],
                "lr": 2e-3,
                "name": "weights",
            },
        ]
    )
    return model, opt


def _step(monitor, model, opt, step, sched=None, source="web", fail=False):
    tokens = torch.randint(0, 256, (2, CFG.seq_len))
    targets = torch.randint(0, 256, (2, CFG.seq_len))
    targets[:, -2:] = IGNORE
    with monitor.step(step) as s:
        s.micro_batch(tokens=tokens, mask=targets != IGNORE, source=source)
        losses = F.cross_entropy(
            model(tokens).transpose(1, 2), targets, ignore_index=IGNORE, reduction="none"
        )
        s.loss(losses)
        (losses.sum() / (targets != IGNORE).sum()).backward()
        if fail:
            raise RuntimeError("boom")
        opt.step()
        if sched is not None:
            sched.step()  # inside the step: the probe still reports the rate the update used
        opt.zero_grad(set_to_none=True)
    return losses.detach().double(), targets != IGNORE


def _events(runs: MemoryTransport) -> list[dict]:
    return [json.loads(v) for _, v in runs.messages]


def test_started_with_config_then_finished_with_lr_per_group_and_source_names():
    model, opt = _model_and_opt()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** (step + 1))
    metrics, runs = MemoryTransport(), MemoryTransport()
    monitor = attach(
        model,
        opt,
        identity=RankIdentity(run_id="r", rank=0, world_size=1),
        config=ProbeConfig(sources=("web", "code"), **QUIET),
        transport=metrics,
        runs=runs,
        run_config={"lr": 2e-3, "batch": 2},
    )
    expected_lrs = []
    losses = []
    for step in range(3):
        expected_lrs.append({"0": opt.param_groups[0]["lr"], "weights": opt.param_groups[1]["lr"]})
        losses.append(_step(monitor, model, opt, step, sched, source=["web", "code"]))
    monitor.close()
    events = _events(runs)
    assert [e["event"] for e in events] == ["started", "finished"]
    # the scans' backend, chosen once at attach, is stored with the run's own config
    assert events[0]["config"] == {"batch": 2, "lr": 2e-3, "probewire.scan_backend": "eager"}
    for step, (key, value) in enumerate(metrics.messages):
        values = decode_rank_step(key, value).values
        lrs = {
            dict(labels)[Label.PARAM_GROUP]: v
            for (name, labels), v in values.items()
            if name == Optim.LR
        }
        assert lrs == expected_lrs[step]
        token_losses, mask = losses[step]
        code = ((Label.SOURCE, "code"),)
        assert values[(Loss.SUM, code)] == pytest.approx(
            float(token_losses[1][mask[1]].sum()), rel=1e-12
        )


def test_an_exception_in_a_step_marks_the_run_crashed_once():
    model, opt = _model_and_opt()
    runs = MemoryTransport()
    monitor = attach(
        model,
        opt,
        identity=RankIdentity(run_id="r", rank=1, world_size=2),
        config=ProbeConfig(**QUIET),
        transport=MemoryTransport(),
        runs=runs,
    )
    with pytest.raises(RuntimeError, match="boom"):
        _step(monitor, model, opt, 0, source=None, fail=True)
    monitor.close()
    [event] = _events(runs)  # rank 1 announces no start and no finish, only its crash
    assert event["event"] == "crashed" and event["rank"] == 1
    assert "step 0: RuntimeError: boom" in event["error"]


def test_unknown_source_name_is_refused_with_the_registered_names():
    model, opt = _model_and_opt()
    monitor = attach(
        model,
        opt,
        identity=RankIdentity(run_id="r", rank=0, world_size=1),
        config=ProbeConfig(sources=("web",), **QUIET),
        transport=MemoryTransport(),
    )
    with pytest.raises(ValueError, match=r"source 'news' is not registered.*\('web',\)"):
        _step(monitor, model, opt, 0, source="news")
    monitor.close()


def test_attach_without_transport_or_broker_says_what_to_do(monkeypatch):
    monkeypatch.delenv("PROBEWIRE_KAFKA__BOOTSTRAP", raising=False)
    model, opt = _model_and_opt()
    with pytest.raises(ValueError, match="probewire run"):
        attach(model, opt, identity=RankIdentity(run_id="r", rank=0, world_size=1))


def test_attach_says_once_which_modules_it_looked_at_when_a_probe_finds_nothing(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with caplog.at_level(logging.WARNING, logger="probewire.instrument.monitor"):
        monitor = attach(
            model,
            identity=RankIdentity(run_id="r", rank=0, world_size=1),
            config=ProbeConfig(**QUIET),
            transport=MemoryTransport(),
        )
    monitor.close()
    head = [r.message for r in caplog.records if "no output head" in r.message]
    assert len(head) == 1 and "[0, 1, 2]" in head[0] and "logits_module" in head[0]
    assert monitor.unhooked and all("matched none" in m for m in monitor.unhooked)


def test_attach_from_the_environment_says_once_when_no_broker_answers(monkeypatch, caplog):
    """The variables `probewire up` exports, left over after it stopped: training goes on,
    and attach says so once."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PROBEWIRE_KAFKA__BOOTSTRAP", f"127.0.0.1:{port}")
    monkeypatch.setenv("PROBEWIRE_RUN_ID", "env-run")
    monkeypatch.delenv("RANK", raising=False)
    model, opt = _model_and_opt()
    with caplog.at_level(logging.WARNING, logger="probewire.instrument.lifecycle"):
        monitor = attach(model, opt, config=ProbeConfig(**QUIET))
    assert monitor.identity.run_id == "env-run" and monitor.identity.world_size == 1
    _step(monitor, model, opt, 0, source=None)
    monitor.close(timeout_s=0.5)
    said = [r.message for r in caplog.records if "no Kafka broker" in r.message]
    assert len(said) == 1 and "probewire up" in said[0]
