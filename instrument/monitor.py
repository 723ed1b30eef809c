"""Attach once, then mark steps: the rank-side monitor.

``attach`` registers every observation point at model-build time (module forward hooks
chosen by name/type pattern, optimizer step hooks, collective wrappers, the control
listener) and returns a ``Monitor``. The loop marks each optimizer step with a context::

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

A loop that clips by itself calls ``s.gradients(scaler=...)`` after the last backward
(accumulated, unscaled, not yet clipped) and may pass the norm it clipped with to
``s.clipped(norm)``. A pipeline stage without the loss simply makes no ``loss`` call.
A loop that times a collective the monitor cannot wrap (DDP's gradient all-reduce, through
a comm hook) reports this rank's exposed wait with ``s.comm_wait("ddp_allreduce", seconds)``;
the stream takes it off the rank's step time to name a straggler.

At the end of the step the monitor gathers the step's device vectors, starts one copy to
the host and enqueues the record; the emitter thread waits for the copy and exports. No
host synchronisation is added on the training thread. A disabled config returns
``NullMonitor``: same methods, no hooks, no thread, no work (its ``clip_grad_norm_``
still clips).
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

import torch
from torch import nn

from .catalog import Priority
from .collect import StepCollector
from .comm import CommTimer
from .config import ProbeConfig
from .control import ControlListener, checkpoint_event
from .export import RankIdentity, StepEmitter, Transport
from .hooks import forward_hook, logits_hook, optimizer_hooks
from .otlp import Point
from .probes import grad_norms, inverse_scale, loss_components, output_head, output_top2
from .registry import GRAD_GROUPS, build_registry
from .structure_probes import attach_structure
from .steps import (NullStepContext, StepContext, decode_clipped, decode_grad_detail, decode_head,
                    decode_norms, decode_top2, loss_decoder)
from .system import (DeviceTelemetry, HostTelemetry, default_flops_per_token, peak_memory_points,
                     reset_peaks)
from .tensors import Entry, parameter_entries, scan_deferred

__all__ = ["Monitor", "NullMonitor", "attach"]

log = logging.getLogger(__name__)
F64 = torch.float64


class Monitor:
    """The attached monitor of one rank (build it with ``attach``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 identity: RankIdentity, config: ProbeConfig, transport: Transport,
                 control: ControlListener | None = None, events: Transport | None = None) -> None:
        self.config, self.identity = config, identity
        self._every = tuple(config.every(p) for p in Priority)
        self._emitter = StepEmitter(identity, transport, queue_size=config.queue_size,
                                    ring_steps=config.ring_steps, encoder=config.encoder)
        self._events = events
        self._registry = build_registry(model, config, identity)
        self._labels = (*config.sources, *config.modalities)
        self._decode_loss = loss_decoder(tuple((("source", name),) for name in self._labels))
        self._chunk = config.scan_chunk_elems
        self._mask_activations = config.mask_activations
        self._update_ratio = config.update_ratio
        self._flops_per_token = (config.flops_per_token if config.flops_per_token is not None
                                 else default_flops_per_token(model, self._registry.n_params))
        first = next(model.parameters(), None)
        self._cuda = first.device if first is not None and first.is_cuda else None
        # per-step state (all flags False outside a step: hooks then do nothing)
        self._p0_on = self._p1_on = self._p2_on = self._tensors_on = False
        self._step: int | None = None
        self._next_step = 0
        self._t0 = 0.0
        self._collector = StepCollector()
        self._mask: torch.Tensor | None = None
        self._mask_total: tuple[torch.Tensor, torch.Tensor] | None = None
        self._source: torch.Tensor | None = None
        self._modality: torch.Tensor | None = None
        self._positions = 0
        self._grads: torch.Tensor | None = None
        self._grad_scans: tuple[torch.Tensor, tuple[int, ...]] | None = None
        self._clip: torch.Tensor | float | None = None
        self._pending_bwd: dict[str, int] = {}
        self._deferred: list[Entry] = []
        self._guard = [0, 0, 0]          # skipped, replayed, replay_mismatch since last emit
        self._comm_reported: dict[str, float] = {}  # op -> wait the loop reported (comm_wait)
        self._dense_until = -1
        self._commands: queue.SimpleQueue[int] = queue.SimpleQueue()
        self.last_step_time_s = 0.0      # the step time of the last closed step context
        self.emit_time_s = 0.0           # training-thread time spent sealing + enqueueing
        self.emitted_steps = 0
        self._ctx = StepContext(self)
        self._extensions: list[Any] = []
        self._handles: list[Any] = []
        self._register(model, optimizer)
        self._structure = attach_structure(self, model, config.structure)
        if self._structure is not None:
            self.add_extension(self._structure)
        self._comm = CommTimer()
        if config.comm:
            self._comm.install()
        self._host = (HostTelemetry(read_network=identity.local_rank == 0)
                      if config.telemetry else None)
        self._device = DeviceTelemetry(self._cuda) if config.telemetry else None
        self._control = control
        if control is not None:
            control.start(self.densify, self.dump)

    # ------------------------------------------------------------------ attach time
    def _register(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        registry = self._registry
        self._tensor_hooks = [(obs.module, forward_hook(self, obs))
                              for obs in registry.modules if obs.report]
        self._armed: list[Any] = []
        if self.config.persistent_hooks:
            self._handles += [m.register_forward_hook(h) for m, h in self._tensor_hooks]
        if registry.logits is not None and registry.logits.report:
            self._handles.append(registry.logits.module.register_forward_hook(logits_hook(self)))
        self._grad_params = [info for info in registry.params if info.in_grad]
        self._param_names = {id(i.param): (i.name, *(f"{i.name}.{p}" for p in i.parts))
                             for i in registry.params}
        if optimizer is not None:
            in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
            reported = [i for i in registry.params if i.report and id(i.param) in in_optimizer]
            pre, post = optimizer_hooks(self, reported, optimizer)
            self._handles += [optimizer.register_step_pre_hook(pre),
                              optimizer.register_step_post_hook(post)]

    # ------------------------------------------------------------------ control (any thread)
    def densify(self, steps: int) -> None:
        """Run the P0 and P1 probes on every step for the next ``steps`` steps (thread-safe).

        P2 forensics stay on demand (their cadence): on the demo MoE, densified P2 views
        raised the rank's peak RSS by ~115 MiB and paged peak_memory on the monitor's own
        allocations; P1 alone adds ~10-25 MiB of transients."""
        self._commands.put(int(steps))

    def dump(self) -> None:
        """Re-send the ring buffer's step records through the emitter (thread-safe)."""
        self._emitter.dump()

    # ------------------------------------------------------------------ the loop's API
    def step(self, step: int) -> StepContext:
        """The context of optimizer step ``step``; enter it before loading the batch."""
        if self._step is not None:
            raise RuntimeError(f"step {step} opened inside step {self._step}")
        self._next_step = int(step)
        return self._ctx

    def sampled(self, priority: Priority | str) -> bool:
        """Whether probes of ``priority`` run in the current step."""
        return (self._p0_on, self._p1_on, self._p2_on)[list(Priority).index(Priority(priority))]

    def checkpoint(self, path: str, step: int, tokens: int, flops: float,
                   weights_stream: str = "raw", key: bool = False) -> bool:
        """Rank 0 publishes {run_id, step, tokens, flops, path, weights_stream, key} to the
        checkpoints topic (key = run_id). Other ranks and a monitor without an events
        transport do nothing. Returns whether a message was handed to the transport."""
        body = checkpoint_event(run_id=self.identity.run_id, path=str(path), step=int(step),
                                tokens=int(tokens), flops=float(flops),
                                weights_stream=weights_stream, key=key)
        if self.identity.rank != 0 or self._events is None:
            return False
        return self._events.send(self.identity.run_id.encode(), body)

    def add_extension(self, extension: Any) -> None:
        """Another probe set sharing this monitor's step (e.g. the model-structure probes).

        It may define ``on_gradients(inv_scale)`` (called where the gradient probe runs:
        accumulated, before clipping), ``finish()`` (end of a sampled step, before the step's
        vectors are gathered) and ``remove()`` (on close). It adds to ``_collector`` itself.
        """
        self._extensions.append(extension)

    def _notify(self, event: str, *args: Any) -> None:
        for extension in self._extensions:
            method = getattr(extension, event, None)
            if method is not None:
                method(*args)

    @property
    def stats(self) -> dict[str, int]:
        e = self._emitter
        return {"sent": e.sent, "dropped": e.dropped, "errors": e.errors, "replayed": e.replayed}

    def close(self, timeout_s: float = 30.0) -> None:
        """Remove every hook, restore the collectives, stop the listener, drain the emitter."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._notify("remove")
        self._extensions.clear()
        self._comm.restore()
        if self._control is not None:
            self._control.close()
        self._emitter.close(timeout_s)
        if self._events is not None:
            self._events.flush(timeout_s)
            self._events.close()
            self._events = None

    detach = close

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ step internals
    def _mask_count(self, mask: torch.Tensor) -> torch.Tensor:
        cached = self._mask_total
        if cached is not None and cached[0] is mask:
            return cached[1]
        count = mask.sum(dtype=F64)
        self._mask_total = (mask, count)
        return count

    def _begin(self) -> None:
        step = self._next_step
        while not self._commands.empty():
            self._dense_until = step + self._commands.get_nowait()
        dense = step < self._dense_until
        k0, k1, k2 = self._every
        self._p0_on = dense or (k0 > 0 and step % k0 == 0)
        self._p1_on = dense or (k1 > 0 and step % k1 == 0)
        self._p2_on = k2 > 0 and step % k2 == 0  # forensics stay on demand: not densified
        self._tensors_on = self._p1_on
        if self._p1_on and not self.config.persistent_hooks:
            self._armed = [m.register_forward_hook(h) for m, h in self._tensor_hooks]
        self._comm.active = self._p1_on
        self._step = step
        if self._p0_on:
            reset_peaks(self._cuda)
        self._t0 = time.perf_counter()

    def _end(self, ok: bool) -> None:
        step = self._step
        sampled = self._p0_on or self._p1_on or self._p2_on
        try:
            if ok and sampled and step is not None:
                self._notify("finish")
                if self._deferred:
                    scan_deferred(self)  # the step's P1 tensor observations, in one batch
            elapsed = time.perf_counter() - self._t0
            self.last_step_time_s = elapsed
            if ok and sampled and step is not None:
                start = time.perf_counter()
                self._emit(step, elapsed)
                self.emit_time_s += time.perf_counter() - start
                self.emitted_steps += 1
        finally:
            self._reset()

    def _reset(self) -> None:
        for handle in self._armed:
            handle.remove()
        self._armed = []
        self._p0_on = self._p1_on = self._p2_on = self._tensors_on = False
        self._comm.active = False
        self._step = None
        self._mask = self._mask_total = self._source = self._modality = None
        self._positions = 0
        self._grads = self._grad_scans = self._clip = None
        self._comm_reported = {}  # a new dict: a late sampler may still hold the last one
        self._pending_bwd.clear()
        self._deferred = []
        self._collector.clear()

    def _emit(self, step: int, elapsed: float) -> None:
        points: list[Point] = []
        late = []
        collector = self._collector
        if self._p0_on:
            points.append(Point("step_time_s", elapsed))
            if self._positions:
                points += [Point("tokens.positions", float(self._positions)),
                           Point("flops.step", self._flops_per_token * self._positions)]
            points += peak_memory_points(self._cuda, self._p1_on)
            skipped, replayed, mismatch = self._guard
            points += [Point("guard.skipped", skipped), Point("guard.replayed", replayed),
                       Point("guard.replay_mismatch", mismatch)]
            self._guard = [0, 0, 0]
        threshold = self.config.clip_threshold
        if self._grads is not None:
            derive = threshold if (self._clip is None and self._registry.whole_gradient) else None
            collector.add("grad.norms", self._grads, decode_norms, derive)
        if self._clip is not None and threshold is not None:
            if isinstance(self._clip, torch.Tensor):
                collector.add("grad.clipped", self._clip.detach().reshape(1),
                              decode_clipped, threshold)
            else:
                points.append(Point("grad.clipped", float(self._clip > threshold)))
        if self._grad_scans is not None:
            rows, present = self._grad_scans
            width = rows.shape[0] // (len(GRAD_GROUPS) + 1)
            collector.add("grad.detail", rows, decode_grad_detail, (present, width))
        reported = self._comm_reported  # the loop's own waits (comm_wait): every emitted step
        if not self._p1_on:
            points += [Point("comm.wait_s", wait, (("op", op),))
                       for op, wait in sorted(reported.items())]
        if self._p1_on:
            if threshold is not None:
                points.append(Point("grad.clip_threshold", threshold))
            late.append(self._comm.take(reported))  # merged with the wrappers' waits
            if self._host is not None:
                late.append(self._host.sample)
            if self._device is not None and self._device.available:
                late.append(self._device.sample)
        self._emitter.submit(collector.seal(step, points, late))

    # ------------------------------------------------------------------ step probes
    def _record_loss(self, losses: torch.Tensor, mask: torch.Tensor | None,
                     source: torch.Tensor | None, modality: torch.Tensor | None) -> None:
        if not self._p0_on:
            return
        mask = self._mask if mask is None else mask
        source = self._source if source is None else source
        modality = self._modality if modality is None else modality
        ids = ((source, 0), (modality, len(self.config.sources)))
        vec, meta = loss_components(losses, mask, ids, len(self._labels))
        self._collector.add("loss", vec, self._decode_loss, meta)

    def _record_totals(self, loss_sum: Any, valid_tokens: Any) -> None:
        if not self._p0_on:
            return
        device = next((v.device for v in (loss_sum, valid_tokens) if isinstance(v, torch.Tensor)),
                      torch.device("cpu"))
        parts = [v.detach().reshape(1) if isinstance(v, torch.Tensor)  # no copy: a fill kernel
                 else torch.full((1,), float(v), dtype=F64, device=device)
                 for v in (loss_sum, valid_tokens)]
        self._collector.add("loss", parts, self._decode_loss, (1, (), False, len(self._labels)))

    def _record_head(self, logits: torch.Tensor) -> None:
        mask = self._mask
        vec, meta = output_head(logits, mask)
        self._collector.add("output.head", vec, decode_head, meta)
        if self._p1_on:
            self._collector.add("output.top2", output_top2(logits, mask), decode_top2)

    def _clip_grad_norm(self, parameters: Any, max_norm: float, norm_type: float,
                        error_if_nonfinite: bool) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in params if p.grad is not None]
        if self._p1_on:  # the detail scans read the gradients before they are clipped
            self._record_gradients(None, None, norm=False)
        elif self._p0_on:
            self._notify("on_gradients", None)
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
        if self._p0_on and grads:
            owned = {id(i.param) for i in self._grad_params if i.param.grad is not None}
            if norm_type == 2.0 and owned == {id(p) for p in params if p.grad is not None}:
                self._grads = total.detach().reshape(1)  # the clipping norm is this rank's G2
            else:  # a subset, another norm, or replicas this rank does not count: measure
                self._record_gradients(None, None, detail=False, notify=False)
            self._clip = total.detach()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def _record_gradients(self, scaler: Any, scale: Any, *, norm: bool = True,
                          detail: bool = True, notify: bool = True) -> None:
        if not (self._p0_on or self._p1_on):
            return
        infos = [i for i in self._grad_params if i.param.grad is not None]
        if not infos:
            return
        inv = inverse_scale(scaler, scale)
        if notify:
            self._notify("on_gradients", inv)
        grads = [i.param.grad.detach() for i in infos]
        if self._p0_on and norm:
            self._grads = grad_norms(grads, inv)
        if self._p1_on and detail:  # copies (unscaled): clipping must not reach them
            for info, grad in zip(infos, grads):
                copy = grad * inv if inv is not None else grad.clone()
                self._deferred += parameter_entries(
                    self._param_names, "grad", [(info.param, copy)], emit=info.report,
                    group=info.group)


class NullMonitor:
    """The disabled monitor: the same API, no hooks, no thread, no work."""

    config = ProbeConfig(enabled=False)
    last_step_time_s = 0.0
    emit_time_s = 0.0
    emitted_steps = 0
    stats = {"sent": 0, "dropped": 0, "errors": 0, "replayed": 0}

    def __init__(self) -> None:
        self._ctx = NullStepContext()

    def step(self, step: int) -> NullStepContext:
        return self._ctx

    def sampled(self, priority: Priority | str) -> bool:
        return False

    def densify(self, steps: int) -> None:
        return None

    def dump(self) -> None:
        return None

    def checkpoint(self, path: str, step: int, tokens: int, flops: float,
                   weights_stream: str = "raw", key: bool = False) -> bool:
        return False

    def close(self, timeout_s: float = 30.0) -> None:
        return None

    detach = close

    def __enter__(self) -> "NullMonitor":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def attach(model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
           identity: RankIdentity, config: ProbeConfig | None = None,
           transport: Transport, control: ControlListener | None = None,
           events: Transport | None = None) -> Monitor | NullMonitor:
    """Register the observation points of ``model`` and ``optimizer``; decide everything now.

    ``transport`` receives the OTLP step messages; ``events`` (optional) the checkpoint
    announcements; ``control`` (optional) is started and fed to ``densify``/``dump``.
    With ``config.enabled`` False the null monitor comes back and nothing is registered.
    """
    config = config or ProbeConfig()
    if not config.enabled:
        return NullMonitor()
    return Monitor(model, optimizer, identity=identity, config=config, transport=transport,
                   control=control, events=events)
