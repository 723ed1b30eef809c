"""The step context: the loop marks each optimizer step with it and hands it what only the
loop knows (micro-batch composition, per-token losses, the gradient point, the clipping
norm, collective waits, spike-guard events). It records them into the rank's
``StepState`` through the probe homes, and at the step's end seals the step's device parts
into one transfer and hands the record to the emitter. Every method is a no-op on a step
where its probe is not due, so the loop never branches.

A sampled step also keeps references to its loss and gradient-norm tensors (``Kept``, the
last ``replay_steps`` steps; no copy, no kernel) so that ``ReplayContext`` can re-run it
under dense probes after it closed and judge the replay (``replay``).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from .catalog import Tier
from .collect import SealedStep
from .probes.comm import CommTimer
from .probes.grads import GradProbe
from .probes.loss import KEY as LOSS_KEY
from .probes.loss import LossProbe
from .probes.optim import OptimProbe
from .probes.system import SystemProbe
from .probes.tensors import TensorProbe
from .replay import Kept, ReplayVerdict, judge, totals
from .state import Schedule, StepState
from .userlog import UserLog

__all__ = [
    "NullReplayContext",
    "NullStepContext",
    "ProbeSet",
    "Probes",
    "ReplayContext",
    "StepContext",
]

_DENSE = {tier: tier in (Tier.STEP, Tier.SCAN) for tier in Tier}
"""A replay's tiers: what ``densify`` runs (forensics, the demand tier, never densify)."""


class ProbeSet(Protocol):
    """A set of probes that shares the monitor's step (the structure probes, or a user's own):
    it adds its device parts to ``state.collector`` from its own hooks, hears about the
    gradient point (accumulated, before clipping; ``inv_scale`` removes a loss scale, None
    when there is none), finishes its work when a sampled step ends (before the step is
    sealed), and removes its hooks on close."""

    def on_gradients(self, state: StepState, inv_scale: Any) -> None: ...

    def finish(self, state: StepState) -> None: ...

    def remove(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Probes:
    """The probes one monitor attached, decided at attach time."""

    loss: LossProbe
    grads: GradProbe
    tensors: TensorProbe
    system: SystemProbe
    comm: CommTimer
    sets: list[ProbeSet]  # the structure probes and a user's own (``add_extension``)
    optim: OptimProbe | None = None  # learning rates; None without an optimizer


class StepContext:
    """Marks one optimizer step (see the module docstring); reused step after step."""

    __slots__ = (
        "_state",
        "_schedule",
        "_probes",
        "_submit",
        "_next",
        "_on_error",
        "_kept",
        "_kept_max",
        "_replay",
        "user",
    )

    def __init__(
        self,
        state: StepState,
        schedule: Schedule,
        probes: Probes,
        submit: Callable[[SealedStep], None],
        on_error: Callable[[int | None, BaseException], None] | None = None,
        replay_steps: int = 0,
        user: UserLog | None = None,
    ) -> None:
        self.user = user if user is not None else UserLog(rank=0)  # the loop's own metrics
        self._state, self._schedule, self._probes, self._submit = state, schedule, probes, submit
        self._next = 0
        self._on_error = on_error  # an exception left the step: the run crashed
        # the last sampled steps' loss and gradient-norm tensors (references), by step
        self._kept: dict[int, Kept] = {}  # oldest first
        self._kept_max = replay_steps
        self._replay: Kept | None = None  # the open step is a replay of this kept step

    def at(self, step: int) -> StepContext:
        """This context, for optimizer step ``step`` (enter it before loading the batch)."""
        if self._state.step is not None:
            raise RuntimeError(f"step {step} opened inside step {self._state.step}")
        self._next = int(step)
        return self

    def replay(self, step: int, params: list[torch.Tensor], rtol: float = 0.0) -> ReplayContext:
        """A context that re-runs kept step ``step`` under dense probes (``ReplayContext``)."""
        if self._state.step is not None:
            raise RuntimeError(
                f"replay of step {step} opened inside step {self._state.step}; "
                "replay a step after its step context closed"
            )
        kept = self._kept.get(int(step))
        if kept is None:
            held = ", ".join(map(str, self._kept)) or "none"
            raise ValueError(
                f"replay of step {step}: not kept (the monitor keeps the last "
                f"ProbeConfig.replay_steps={self._kept_max} steps whose step tier "
                f"ran; kept: {held})"
            )
        if not rtol >= 0:
            raise ValueError(f"replay of step {step}: rtol must be >= 0, got {rtol!r}")
        return ReplayContext(self, int(step), kept, params, float(rtol))

    # ------------------------------------------------------------------ boundaries
    def __enter__(self) -> StepContext:
        state, probes = self._state, self._probes
        step = self._next
        if self._replay is not None:  # dense probes; no system, collective or optimizer probe
            state.open(step, dict(_DENSE), 0.0)
            probes.tensors.open(state)
            state.t0 = time.perf_counter()
            return self
        due = self._schedule.due(step)
        held = self._schedule.held(step, due)
        if held:  # the scan probes run; their points go to the ring (``export``)
            due = {**due, Tier.SCAN: True}
        state.open(step, due, 0.0, held)
        probes.tensors.open(state)
        probes.comm.open(state)
        probes.system.open(state)
        if probes.optim is not None:
            probes.optim.open(state)
        state.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        state, probes = self._state, self._probes
        ok, step = exc_type is None, state.step
        try:
            if ok and state.sampled and step is not None:
                for probe_set in probes.sets:
                    probe_set.finish(state)
                probes.tensors.close(state)  # the step's scans, in one batch
            if self._replay is not None:
                if ok and step is not None:
                    self._close_replay(state, step)
                return False
            elapsed = time.perf_counter() - state.t0
            state.last_step_time_s = elapsed
            if ok and step is not None:
                user = self.user.close(step, state.sampled)
            if ok and state.sampled and step is not None:
                start = time.perf_counter()
                points: list = user
                late: list = []
                probes.system.close(state, elapsed, points, late)
                if probes.optim is not None:
                    probes.optim.close(state, late)
                probes.grads.close(state, points, late)
                probes.comm.close(state, late)
                retired = self._keep(step, state)
                sealed = state.collector.seal(step, points, late, held=state.held)
                sealed.retired = retired  # freed with the record, on the emitter thread
                self._submit(sealed)
                state.emit_time_s += time.perf_counter() - start
                state.emitted_steps += 1
            if not ok and self._on_error is not None:
                self._on_error(step, exc)
        finally:
            probes.tensors.disarm()
            probes.comm.active = False
            state.reset()
        return False

    def _kept_of(self, state: StepState) -> Kept:
        return Kept(
            state.collector.parts(LOSS_KEY),
            state.g2,
            state.due[Tier.SCAN] and not state.held,
        )

    def _keep(self, step: int, state: StepState) -> Kept | None:
        """Keep this step's loss and gradient-norm tensors (references) for a replay; returns
        the record this one pushed out, if any (for the caller to free off this thread)."""
        if self._kept_max and state.collector.has(LOSS_KEY):
            kept = self._kept
            kept.pop(step, None)  # a step run again replaces its record, newest last
            kept[step] = self._kept_of(state)
            if len(kept) > self._kept_max:
                return kept.pop(next(iter(kept)))
        return None

    def _close_replay(self, state: StepState, step: int) -> None:
        """A replay's end: its record (scan-tier detail, sent marked replay unless the step
        already sent its own) and its ``Kept`` for the verdict (``ReplayContext``)."""
        probes = self._probes
        points: list = []
        late: list = []
        probes.grads.close(state, points, late)
        original = self._replay
        self._replay = self._kept_of(state)  # handed to ReplayContext.__exit__
        sealed = state.collector.seal(step, points, late, replay=True)
        if original is not None and not original.scanned:
            self._submit(sealed)

    # ------------------------------------------------------------------ what the loop tells
    @property
    def step(self) -> int | None:
        return self._state.step

    def sampled(self, tier: Tier | str) -> bool:
        """Whether the probes of ``tier`` ("step", "scan", "demand") run in this step."""
        return self._state.due[Tier(tier)]

    def micro_batch(
        self,
        *,
        tokens: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        source: torch.Tensor | None = None,
        modality: torch.Tensor | None = None,
    ) -> None:
        """Composition of the next forward pass: input ``tokens`` [B, T] (their count is the
        step's positions for flops.step), the valid-target ``mask`` [B, T] (bool), and
        ``source`` / ``modality`` ids (row [B] or token [B, T]) indexing the registered
        ``ProbeConfig.sources`` / ``modalities``. Stores references only: do not modify
        these tensors in place before the step's record is exported (the next step)."""
        state = self._state
        state.mask, state.source, state.modality = mask, source, modality
        if tokens is not None:
            state.positions += tokens.numel()
        elif mask is not None:
            state.positions += mask.numel()

    def loss(
        self,
        token_losses: torch.Tensor,
        mask: torch.Tensor | None = None,
        *,
        source: torch.Tensor | None = None,
        modality: torch.Tensor | None = None,
    ) -> None:
        """Per-token NLL of one micro-batch (``reduction="none"``); mask/ids default to the
        current ``micro_batch``'s."""
        self._probes.loss.record(self._state, token_losses, mask, source, modality)

    def loss_totals(self, loss_sum: torch.Tensor | float, valid_tokens: torch.Tensor | int) -> None:
        """For fused losses that only return a sum: the micro-batch's Σ m·ℓ and Σ m."""
        self._probes.loss.record_totals(self._state, loss_sum, valid_tokens)

    def gradients(self, *, scaler: Any = None, scale: Any = None) -> None:
        """Measure the gradients now: after accumulation (call it after the last backward),
        loss scale removed (pass the ``GradScaler`` or the scale), before clipping."""
        self._probes.grads.record(self._state, scaler, scale)

    def clip_grad_norm_(
        self,
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that is also the gradient probe: the gradient
        statistics are taken first (accumulated, unscaled — call it after
        ``GradScaler.unscale_`` — and not yet clipped), then the same total norm clips.
        One norm computation serves both, so grad.norm_sq is the clipping norm squared, and
        ``max_norm`` is the c of grad.clipped (``grads.clip_threshold``). Returns the total
        norm, as torch's does."""
        return self._probes.grads.clip_grad_norm_(
            self._state, parameters, max_norm, norm_type, error_if_nonfinite
        )

    def clipped(self, total_norm: torch.Tensor | float, *, max_norm: float | None = None) -> None:
        """The global norm the loop clipped with (``clip_grad_norm_``'s return value, a
        device tensor is fine) and the ``max_norm`` it clipped to:
        grad.clipped = 1[total_norm > c], c = ``max_norm``, else ``ProbeConfig.clip_threshold``
        (``grads.clip_threshold``); c is sent as grad.clip_threshold."""
        self._probes.grads.clipped(self._state, total_norm, max_norm)

    def comm_wait(self, op: str, seconds: float) -> None:
        """This rank's exposed wait on collective ``op`` in this step, measured by the loop
        itself (a host float, seconds >= 0): for collectives the monitor's wrappers cannot
        see, such as DDP's bucketed gradient all-reduce timed by a comm hook (report it
        under an op name of its own, e.g. ``"ddp_allreduce"``). Sent as ``comm.wait_s{op}``;
        calls for one op in one step add up, and add to what the wrappers timed for the same
        op name. The stream subtracts a rank's waits from its step time to tell a straggler
        from the ranks that wait for it."""
        seconds = _check_wait(op, seconds)
        state = self._state
        if state.sampled:
            state.comm_waits[op] = state.comm_waits.get(op, 0.0) + seconds

    def log(self, name: str, value: Any, reduction: str = "mean") -> None:
        """A metric of the user's own (an eval accuracy, a data-loader metric) for this step:
        ``value`` a number (a one-element tensor is read with ``float``, a host sync),
        ``reduction`` over ranks "mean", "sum", "max" or "rank0" (rank 0's value only).
        Stored in ``user_metrics``; the rules are ``userlog``'s (name, bound, step). In a
        replay (``Monitor.replay``) it checks the call and sends nothing: the step's own
        values went with the step."""
        if self._replay is not None:
            UserLog(rank=0).log(name, value, reduction)
            return
        self.user.log(name, value, reduction, self._state.step)

    def skipped(self) -> None:
        """The spike guard skipped this step's update."""
        self._state.guard[0] += 1

    def replayed(self, *, reproduced: bool) -> None:
        """The step was replayed; ``reproduced`` False when the replay's loss differed."""
        _count_replay(self._state, reproduced)


def _count_replay(state: StepState, reproduced: bool) -> None:
    """The guard's replay counters (guard.replayed, guard.replay_mismatch), sent with the
    next emitted step."""
    state.guard[1] += 1
    if not reproduced:
        state.guard[2] += 1


class ReplayContext:
    """Re-runs kept step ``step`` under dense probes (the step and scan tiers; build it with
    ``Monitor.replay``). Enter it after step ``step`` closed, with the parameters as they
    were (an update the guard skipped, or before any update), and run the step's forward
    and backward on the same batch inside it, marking it as the step did (``micro_batch``,
    ``loss``, ``gradients`` or ``clip_grad_norm_``); never step the optimizer in it. The
    parameters' gradients are set aside on entry and put back on exit, so the replay's own
    gradients are dropped. On exit the replay is judged against what the step kept
    (``replay.judge``; ``verdict``), counted in the guard's counters (sent with the next
    emitted step: guard.replayed, and guard.replay_mismatch when not reproduced), and its
    scan-tier detail is sent once, marked replay, when the step did not send its own."""

    __slots__ = ("_ctx", "step", "_kept", "_params", "_rtol", "_grads", "verdict")

    def __init__(
        self, ctx: StepContext, step: int, kept: Kept, params: list[torch.Tensor], rtol: float
    ) -> None:
        self._ctx, self.step, self._kept, self._params, self._rtol = ctx, step, kept, params, rtol
        self._grads: list[Any] = []
        self.verdict: ReplayVerdict | None = None

    def __enter__(self) -> StepContext:
        ctx = self._ctx
        self._grads = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        ctx._next, ctx._replay = self.step, self._kept
        try:
            return ctx.__enter__()
        except BaseException:
            self._restore()
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        ctx = self._ctx
        try:
            ctx.__exit__(exc_type, exc, tb)
            replayed = ctx._replay
        finally:
            ctx._replay = None
            self._restore()
        if exc_type is None and replayed is not None:
            self.verdict = judge(self.step, totals(self._kept), totals(replayed), self._rtol)
            _count_replay(ctx._state, self.verdict.reproduced)
        return False

    def _restore(self) -> None:
        for p, g in zip(self._params, self._grads):
            p.grad = g
        self._grads = []


class NullReplayContext:
    """The disabled monitor's replay: runs the block, judges nothing (``verdict`` None)."""

    __slots__ = ()
    verdict = None

    def __enter__(self) -> NullStepContext:
        return NullStepContext()

    def __exit__(self, *exc: Any) -> Literal[False]:
        return False


class NullStepContext:
    """The disabled monitor's step: every method accepts the same arguments and does nothing."""

    __slots__ = ()
    step = None

    def __enter__(self) -> NullStepContext:
        return self

    def __exit__(self, *exc: Any) -> Literal[False]:
        return False

    def sampled(self, tier: Tier | str) -> bool:
        return False

    def micro_batch(self, **kwargs: Any) -> None:
        return None

    def loss(self, token_losses: Any, mask: Any = None, **kwargs: Any) -> None:
        return None

    def loss_totals(self, loss_sum: Any, valid_tokens: Any) -> None:
        return None

    def gradients(self, **kwargs: Any) -> None:
        return None

    def clipped(self, total_norm: Any, *, max_norm: float | None = None) -> None:
        return None

    def clip_grad_norm_(
        self,
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)

    def comm_wait(self, op: str, seconds: float) -> None:
        _check_wait(op, seconds)

    def log(self, name: str, value: Any, reduction: str = "mean") -> None:
        UserLog(rank=0).log(name, value, reduction)  # the same checks; nothing is kept

    def skipped(self) -> None:
        return None

    def replayed(self, *, reproduced: bool) -> None:
        return None


def _check_wait(op: Any, seconds: Any) -> float:
    """``comm_wait``'s arguments: a label-safe op name and a finite wait >= 0 (seconds)."""
    if not isinstance(op, str) or not op or op != op.strip() or any(c in op for c in "|="):
        raise ValueError(
            f"comm_wait: op must be a non-empty name without spaces at its ends, "
            f"'|' or '=', got {op!r}"
        )
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise ValueError(f"comm_wait({op!r}): seconds must be a host float, got {seconds!r}")
    value = float(seconds)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"comm_wait({op!r}): seconds must be finite and >= 0, got {value!r}")
    return value
