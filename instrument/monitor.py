"""Attach once, then mark steps: the rank-side monitor.

``attach`` decides everything at model-build time — which modules and parameters are
observed and who reports them (``registry``), the probes (``probes``), the per-step state
they share (``state``), the schedule of tiers, the emitter thread (``export``) and the
control listener — and returns a ``Monitor``. The loop marks each optimizer step::

    monitor = attach(model, optimizer, identity=RankIdentity(run_id="r1", rank=rank,
                     world_size=world), config=ProbeConfig(clip_threshold=1.0,
                     sources=("web", "code")), transport=KafkaTransport(kafka, "otlp_metrics"))
    for step in range(steps):
        with monitor.step(step) as s:
            batch = next(loader)                              # data loading is timed too
            s.micro_batch(tokens=batch.tokens, mask=batch.targets != IGNORE,
                          source=batch.source)                # composition of the next forward
            logits = model(batch.tokens)
            losses = F.cross_entropy(logits.transpose(1, 2), batch.targets,
                                     ignore_index=IGNORE, reduction="none")
            s.loss(losses)                                    # loss.sum / loss.tokens
            (losses.sum() / n_valid).backward()
            s.clip_grad_norm_(model.parameters(), 1.0)        # measures G2, then clips
            optimizer.step(); optimizer.zero_grad()
    monitor.close()

Inside ``probewire run`` (or with what ``probewire up`` prints exported) ``identity`` and
``transport`` may be left out: ``RankIdentity.from_env()`` and the broker of
``PROBEWIRE_KAFKA__BOOTSTRAP`` (``lifecycle``). ``run_config`` (hyper-parameters) is stored
with the run; ``close()`` marks the run finished, an exception out of a step crashed.

A loop that clips by itself calls ``s.gradients(scaler=...)`` after the last backward
(accumulated, unscaled, not yet clipped) and may pass the norm it clipped with to
``s.clipped(norm)``. A pipeline stage without the loss simply makes no ``loss`` call.
A loop that times a collective the monitor cannot wrap (DDP's gradient all-reduce, through
a comm hook) reports this rank's exposed wait with ``s.comm_wait("ddp_allreduce", seconds)``;
the stream takes it off the rank's step time to name a straggler.

At the end of the step the step context gathers the step's device vectors, starts one copy
to the host and enqueues the record; the emitter thread waits for the copy and exports. No
host synchronisation is added on the training thread. A disabled config returns
``NullMonitor``: same methods, no hooks, no thread, no work (its ``clip_grad_norm_``
still clips).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .config import ProbeConfig
from .control import ControlListener, checkpoint_event
from .export import KafkaTransport, StepEmitter, Transport
from .lifecycle import (
    DETAIL_TOPIC,
    RUNS_TOPIC,
    env_transports,
    offline_transports,
    resolve_mode,
    run_event,
)
from .parallel import coords_from_mesh, data_group, verify_replicas
from .probes.comm import CommTimer
from .probes.grads import GradProbe
from .probes.head import logits_hook
from .probes.loss import LossProbe
from .probes.optim import OptimProbe
from .probes.structure import StructureProbes, attach_structure
from .probes.system import SystemProbe, default_flops_per_token
from .probes.tensors import TensorProbe
from .registry import Registry, build_registry
from .state import Schedule, StepState
from .step import NullReplayContext, NullStepContext, Probes, ProbeSet, ReplayContext, StepContext
from .userlog import UserLog
from .wire import RankIdentity

__all__ = ["Monitor", "NullMonitor", "attach"]

log = logging.getLogger(__name__)


def _scan_backend(config: ProbeConfig, device: torch.device | None) -> str:
    """The configured scan backend; "auto" is the compiled one on a GPU, eager elsewhere."""
    if config.scan_backend != "auto":
        return config.scan_backend
    return "compiled" if device is not None else "eager"


def _register_hooks(
    state: StepState,
    registry: Registry,
    optimizer: torch.optim.Optimizer | None,
    tensors: TensorProbe,
    fused: bool,
) -> list[Any]:
    """The logits forward hook and the optimizer's step hooks (of the reported parameters
    the optimizer updates); their handles."""
    handles: list[Any] = []
    if registry.logits is not None and registry.logits.report:
        handles.append(
            registry.logits.module.register_forward_hook(logits_hook(state, fused=fused))
        )
    if optimizer is not None:
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        reported = [i for i in registry.params if i.owned and id(i.param) in in_optimizer]
        pre, post = tensors.optimizer_hooks(reported, optimizer)
        handles += [
            optimizer.register_step_pre_hook(pre),
            optimizer.register_step_post_hook(post),
        ]
    return handles


class Monitor:
    """The attached monitor of one rank (build it with ``attach``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        identity: RankIdentity,
        config: ProbeConfig,
        transport: Transport,
        control: ControlListener | None = None,
        events: Transport | None = None,
        mesh: Any = None,
        runs: Transport | None = None,
        run_config: Mapping[str, Any] | None = None,
        detail: Transport | None = None,
    ) -> None:
        self.config, self.identity = config, identity
        self._runs = runs
        self._ended = False
        self._last_step = -1  # the newest step the loop entered: named in ``finished``
        first = next(model.parameters(), None)
        device = first.device if first is not None and first.is_cuda else None
        self.scan_backend = _scan_backend(config, device)
        # checked first; how the scans run is chosen once, here, and stored with the run
        started = run_event(
            identity,
            "started",
            config={**(run_config or {}), "probewire.scan_backend": self.scan_backend},
        )
        self._state = StepState()
        self._schedule = Schedule(config.cadence, config.ring_every)
        self._emitter = StepEmitter(
            identity,
            transport,
            detail=detail,
            block_ranks=config.block_ranks,
            queue_size=config.queue_size,
            ring_steps=config.ring_steps,
        )
        self._events = events
        registry = build_registry(model, config, identity)
        if config.verify_layout:  # a hand-declared DDP replica must be one (one collective)
            group = data_group(mesh, identity)
            if group is not None:
                verify_replicas(registry.dp_replicas, group, "the data-parallel ranks")
        self.unhooked = _unhooked(model, registry, config)
        for message in self.unhooked:
            log.warning("probewire: %s", message)
        fused = self.scan_backend == "compiled"
        self._probes, self.structure = self._build_probes(model, optimizer, registry, device, fused)
        self._ctx = StepContext(
            self._state,
            self._schedule,
            self._probes,
            self._emitter.submit,
            on_error=self._step_failed,
            replay_steps=config.replay_steps,
            user=UserLog(rank=identity.rank),
        )
        self._params = list(model.parameters())  # a replay sets their gradients aside
        self._handles = _register_hooks(
            self._state, registry, optimizer, self._probes.tensors, fused
        )
        self._control = control
        if control is not None:
            control.start(self.densify, self.dump)
        if identity.rank == 0:
            self._send_run_event(started)

    def _build_probes(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        registry: Registry,
        device: torch.device | None,
        fused: bool,
    ) -> tuple[Probes, StructureProbes | None]:
        """Every probe of the rank, configured once (and the structure probes, or None)."""
        config, state = self.config, self._state
        tensors = TensorProbe(
            state,
            registry,
            chunk_elems=config.scan_chunk_elems,
            mask_activations=config.mask_activations,
            update_ratio=config.update_ratio,
            persistent_hooks=config.persistent_hooks,
            fused=fused,
        )
        sets: list[ProbeSet] = []
        structure = attach_structure(
            state,
            model,
            registry,
            config.structure,
            logits_module=config.logits_module,
            persistent=config.persistent_hooks,
        )
        if structure is not None:
            sets.append(structure)
        comm = CommTimer()
        if config.comm:
            comm.install()
        flops = (
            config.flops_per_token
            if config.flops_per_token is not None
            else default_flops_per_token(model, registry.n_params)
        )
        probes = Probes(
            loss=LossProbe(config.sources, config.modalities),
            grads=GradProbe(
                registry.params,
                tensors,
                sets,
                clip_threshold=config.clip_threshold,
                whole_gradient=registry.whole_gradient,
            ),
            tensors=tensors,
            system=SystemProbe(
                device=device,
                flops_per_token=flops,
                clip_threshold=config.clip_threshold,
                telemetry=config.telemetry,
                read_network=self.identity.local_rank == 0,
            ),
            comm=comm,
            sets=sets,
            optim=OptimProbe(optimizer) if optimizer is not None else None,
        )
        return probes, structure

    # ------------------------------------------------------------------ the loop's API
    def step(self, step: int) -> StepContext:
        """The context of optimizer step ``step``; enter it before loading the batch."""
        self._last_step = max(self._last_step, step)
        return self._ctx.at(step)

    def replay(self, step: int, *, rtol: float = 0.0) -> ReplayContext:
        """Re-run kept step ``step`` under dense probes and judge it (``step.ReplayContext``)::

            replay = monitor.replay(step)          # after step ``step`` closed, no update
            with replay as s:                      # the step's own batch, marked as before
                s.micro_batch(tokens=batch.tokens, mask=batch.targets != IGNORE)
                losses = F.cross_entropy(..., reduction="none"); s.loss(losses)
                (losses.sum() / n_valid).backward(); s.gradients()
            replay.verdict.verdict                 # "data": reproduced; "hardware": not

        ``rtol``: relative tolerance of the loss sum and gradient norm; 0 (the default) is
        bit-exact, right for the same device and deterministic kernels."""
        return self._ctx.replay(step, self._params, rtol)

    @property
    def last_step_time_s(self) -> float:
        """The step time of the last closed step context."""
        return self._state.last_step_time_s

    @property
    def emit_time_s(self) -> float:
        """Training-thread time spent sealing and enqueueing step records, in total."""
        return self._state.emit_time_s

    @property
    def emitted_steps(self) -> int:
        return self._state.emitted_steps

    def checkpoint(
        self,
        path: str,
        step: int,
        tokens: int,
        flops: float,
        weights_stream: str = "raw",
        key: bool = False,
    ) -> bool:
        """Rank 0 publishes {run_id, step, tokens, flops, path, weights_stream, key} to the
        checkpoints topic (key = run_id). Other ranks and a monitor without an events
        transport do nothing. Returns whether a message was handed to the transport."""
        body = checkpoint_event(
            run_id=self.identity.run_id,
            path=str(path),
            step=int(step),
            tokens=int(tokens),
            flops=float(flops),
            weights_stream=weights_stream,
            key=key,
        )
        if self.identity.rank != 0 or self._events is None:
            return False
        return self._events.send(self.identity.run_id.encode(), body)

    def add_extension(self, extension: ProbeSet) -> None:
        """Another probe set sharing this monitor's step (``step.ProbeSet``): it hears about
        the gradient point, finishes its work when a sampled step ends, and is removed on
        close; it adds its own device parts to the step through the ``StepState`` it gets."""
        self._probes.sets.append(extension)

    # ------------------------------------------------------------------ run lifecycle
    def crashed(self, error: BaseException | str, *, step: int = -1) -> None:
        """Mark the run crashed (any rank; once). An exception out of a step context does
        this by itself (with its step); call it for a failure outside the steps."""
        if self._ended:
            return
        self._ended = True
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self._send_run_event(run_event(self.identity, "crashed", error=text, step=step))

    def _step_failed(self, step: int | None, exc: BaseException) -> None:
        self.crashed(f"step {step}: {type(exc).__name__}: {exc}", step=-1 if step is None else step)

    def _send_run_event(self, body: bytes) -> None:
        if self._runs is not None:
            self._runs.send(self.identity.run_id.encode(), body)

    # ------------------------------------------------------------------ control (any thread)
    def densify(self, steps: int) -> None:
        """Run the step and scan tiers on every step for the next ``steps`` steps (thread-safe)."""
        self._schedule.densify(steps)

    def dump(self) -> None:
        """Send the ring buffer's unsent scan-tier detail once, marked as a replay
        (thread-safe); a second dump sends only what was held since."""
        self._emitter.dump()

    def log(
        self, name: str, value: Any, *, step: int | None = None, reduction: str = "mean"
    ) -> None:
        """A metric of the user's own for step ``step`` (None: the step now open, else the
        next one the loop opens), e.g. an evaluation run between steps::

            monitor.log("val_acc", acc, step=step + 1, reduction="rank0")

        ``reduction`` over ranks: "mean", "sum", "max" or "rank0". Inside a step,
        ``s.log(name, value)`` is the same. The rules are ``userlog``'s."""
        self._ctx.user.log(name, value, reduction, step)

    @property
    def stats(self) -> dict[str, int]:
        e = self._emitter
        return {
            "sent": e.sent,
            "dropped": e.dropped,
            "errors": e.errors,
            "replayed": e.replayed,
            "user_dropped": self._ctx.user.dropped,
        }

    def close(self, timeout_s: float | None = None) -> None:
        """Remove every hook, restore the collectives, stop the listener, drain the emitter;
        rank 0 marks the run finished (unless it crashed). Returns within ``timeout_s``
        (default ``ProbeConfig.close_timeout_s``) and half a second per event transport:
        what the broker did not take by then is counted and said in one line."""
        budget = self.config.close_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        if not self._ended and self.identity.rank == 0:
            self._send_run_event(run_event(self.identity, "finished", step=self._last_step))
        self._ended = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._probes.tensors.remove()
        for probe_set in self._probes.sets:
            probe_set.remove()
        self._probes.sets.clear()
        self._probes.comm.restore()
        if self._probes.optim is not None:
            self._probes.optim.remove()
        if self._control is not None:
            self._control.close(min(budget, 10.0))
        self._emitter.close(max(0.0, deadline - time.monotonic()))
        for name in ("_events", "_runs"):
            transport = getattr(self, name)
            if transport is not None:
                transport.flush(max(0.5, deadline - time.monotonic()))
                transport.close()
                setattr(self, name, None)

    detach = close

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is not None:
            self.crashed(exc)
        self.close()


class NullMonitor:
    """The disabled monitor: the same API, no hooks, no thread, no work."""

    config = ProbeConfig(enabled=False)
    structure = None
    last_step_time_s = 0.0
    emit_time_s = 0.0
    emitted_steps = 0
    stats = {"sent": 0, "dropped": 0, "errors": 0, "replayed": 0}

    def __init__(self) -> None:
        self._ctx = NullStepContext()

    def step(self, step: int) -> NullStepContext:
        return self._ctx

    def densify(self, steps: int) -> None:
        return None

    def replay(self, step: int, *, rtol: float = 0.0) -> NullReplayContext:
        return NullReplayContext()

    def dump(self) -> None:
        return None

    def checkpoint(
        self,
        path: str,
        step: int,
        tokens: int,
        flops: float,
        weights_stream: str = "raw",
        key: bool = False,
    ) -> bool:
        return False

    def add_extension(self, extension: Any) -> None:
        return None

    def log(
        self, name: str, value: Any, *, step: int | None = None, reduction: str = "mean"
    ) -> None:
        self._ctx.log(name, value, reduction)  # the same checks; nothing is sent

    def crashed(self, error: Any, *, step: int = -1) -> None:
        return None

    def close(self, timeout_s: float = 30.0) -> None:
        return None

    detach = close

    def __enter__(self) -> NullMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    identity: RankIdentity | None = None,
    config: ProbeConfig | None = None,
    transport: Transport | None = None,
    control: ControlListener | None = None,
    events: Transport | None = None,
    runs: Transport | None = None,
    run_config: Mapping[str, Any] | None = None,
    mesh: Any = None,
    mode: str | None = None,
    detail: Transport | None = None,
) -> Monitor | NullMonitor:
    """Register the observation points of ``model`` and ``optimizer``; decide everything now.

    ``identity`` defaults to ``RankIdentity.from_env()`` (torchrun / SLURM variables and
    ``PROBEWIRE_RUN_ID``). ``transport`` receives the OTLP step messages; without one, the
    broker comes from ``PROBEWIRE_KAFKA__BOOTSTRAP`` (exported by ``probewire up`` /
    ``run``) and the control listener, checkpoint and run-event transports are built too
    (``lifecycle.env_transports``). ``events`` (optional) takes the checkpoint
    announcements, ``runs`` the run's lifecycle events (default: the metrics transport's
    broker, topic ``probewire.runs``, when it is a ``KafkaTransport``), ``detail`` the
    scan-tier points and ring dumps (default: topic ``otlp_detail`` of that broker; with
    another transport and no ``detail``, a step's points travel as one message); ``control``
    (optional) is started and fed to ``densify``/``dump``. ``run_config`` (the run's
    hyper-parameters, a JSON-able mapping) is stored in the run's ``runs.config``.
    ``mesh`` (a ``DeviceMesh`` with named dims: dp / dp_replicate / dp_shard, tp, pp, cp,
    ep) gives this rank's coordinates; DTensor parameters carry their own layout. On a
    multi-rank job ``attach`` is collective when parameters are declared DDP replicas by
    hand (one all_gather checks they are): call it on every rank.
    With ``config.enabled`` False the null monitor comes back and nothing is registered.
    ``mode`` (else ``PROBEWIRE_MODE``, else ``online``): ``online`` as above; ``disabled``:
    the null monitor (no hook, no thread, no socket; the script runs unchanged);
    ``offline``: without a transport, every message goes to a local spool file
    (``spool``) that ``probewire sync DIR`` replays into a stack later.
    """
    config = config or ProbeConfig()
    mode = resolve_mode(mode, os.environ)
    if not config.enabled or mode == "disabled":
        return NullMonitor()
    identity = identity or RankIdentity.from_env()
    if mesh is not None:
        identity = dataclasses.replace(identity, coords=coords_from_mesh(mesh))
    if transport is None:
        build = offline_transports if mode == "offline" else env_transports
        built = build(identity, os.environ)
        transport, runs = built.transport, runs or built.runs
        control = control or built.control
        events = events or built.checkpoints
        detail = detail or built.detail
    elif isinstance(transport, KafkaTransport):
        if runs is None:
            runs = transport.to_topic(os.environ.get("PROBEWIRE_TOPICS__RUNS") or RUNS_TOPIC)
        if detail is None:
            detail = transport.to_topic(os.environ.get("PROBEWIRE_TOPICS__DETAIL") or DETAIL_TOPIC)
    return Monitor(
        model,
        optimizer,
        identity=identity,
        config=config,
        transport=transport,
        control=control,
        events=events,
        runs=runs,
        run_config=run_config,
        mesh=mesh,
        detail=detail,
    )


def _unhooked(model: nn.Module, registry: Any, config: ProbeConfig) -> list[str]:
    """What a probe found nothing to hook on, with the module names it looked at."""
    from .registry import label_name

    seen: list[str] = []
    for qualified, _ in model.named_modules():
        name = re.sub(r"\.\d+(?=\.|$)", ".N", label_name(qualified))
        if name and name not in seen:
            seen.append(name)
    seen = seen or [f"<the root {type(model).__name__}, no submodules>"]
    shown = ", ".join(seen[:25]) + (f", ... ({len(seen)} in all)" if len(seen) > 25 else "")
    messages = []
    if registry.logits is None:
        messages.append(
            f"no output head: ProbeConfig.logits_module {config.logits_module!r} "
            f"matched none of the modules [{shown}]; output.* is not measured "
            "(set logits_module to the module that returns the logits)"
        )
    if not any(not m.is_logits for m in registry.modules):
        messages.append(
            f"no observation point: ProbeConfig.module_names matched none of the "
            f"modules [{shown}]; the tensor scans measure parameters only "
            "(set module_names or module_types)"
        )
    return messages
