"""The gradient probe (seeds 001 §4): G2 and the clip indicator on every step, and per
parameter group (all, embedding, expert, other) Σ|g|, max |g|, zeros, elements, non-finite
and Σg², at the one point the seeds allow: accumulated over micro-batches, loss scale
removed, before clipping.

G2 comes from one fused multi-tensor norm per (device, dtype), combined exactly as
``clip_grad_norm_`` combines them, so it reproduces the clipping norm; through
``StepContext.clip_grad_norm_`` the very norm that clips is the measurement. The group
statistics are taken before the clip runs: on steps without the scan tier each group's
small tensors are copied into one buffer per dtype, a ``cat`` per distinct shape (a few
operations however many tensors), and scanned as one (``gather_groups``; on CPU the copies
are reduced on the emitter thread), on scan steps each tensor is scanned
(``scan_many``) and its row is also emitted as tensor.*{kind=grad}; either way the rows are
combined by group on the host, off the training thread. Parameters that
another rank reports (a replica outside the stream's dedup groups) are left out of this
rank's sums (``registry``).

A model's gradients keep their parameters, sizes and groups from step to step, so the
per-tensor bookkeeping (which are present, their groups, which go whole and which into
which concatenation) is planned once per set of gradients present (``_Plan``), and what
``clip_grad_norm_`` needs to know of the parameters it is given once per list
(``_Clipped``): a step's per-tensor Python is one read of each ``.grad`` and a few
C-level passes over the list (``map``), the copies one ``cat`` per shape.
On 1,000 small parameter tensors that Python, not the kernels, was most of P0's cost.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..batchscan import GroupPlan, GroupScan
from ..catalog import GRAD_GROUPS, Grad, Label, tier_of
from ..collect import Late
from ..parallel import LayoutError, is_dtensor, local
from ..registry import ParamInfo
from ..scan import ScanFields
from ..state import StepState
from ..wire import Labels, Point
from .common import F64
from .tensors import TIER as SCAN_TIER
from .tensors import TensorProbe, scale_scan

__all__ = [
    "GradProbe",
    "amp_skipped",
    "clip_threshold",
    "decode_clipped",
    "decode_grad_detail",
    "decode_norms",
    "grad_norms",
    "inverse_scale",
    "norm_kinds",
]

log = logging.getLogger(__name__)

NORM_TIER = tier_of(Grad.NORM_SQ, Grad.CLIPPED)
DETAIL_TIER = tier_of(Grad.ABS_SUM, Grad.ABS_MAX, Grad.ZEROS, Grad.ELEMENTS, Grad.NONFINITE)
_GROUP_LABELS: tuple[Labels, ...] = tuple(((Label.GROUP, g),) for g in GRAD_GROUPS)
_DETAIL = (
    (Grad.ABS_SUM, ScanFields.SUM_ABS),
    (Grad.ABS_MAX, ScanFields.ABS_MAX),
    (Grad.ZEROS, ScanFields.ZEROS),
    (Grad.ELEMENTS, ScanFields.N),
    (Grad.NONFINITE, ScanFields.NONFINITE),
)


# ------------------------------------------------------------------ device arithmetic
def norm_kinds(grads: Sequence[torch.Tensor]) -> tuple[tuple[int, ...], ...]:
    """The indices of ``grads`` by (device, dtype), as ``clip_grad_norm_`` groups them."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        by_kind.setdefault((g.device, g.dtype), []).append(i)
    return tuple(map(tuple, by_kind.values()))


def grad_norms(
    grads: Sequence[torch.Tensor],
    inv_scale: torch.Tensor | float | None,
    kinds: tuple[tuple[int, ...], ...] | None = None,
) -> torch.Tensor:
    """``‖g‖`` over all gradient elements, loss scale removed (seeds 001 §4), shape [1].

    Per-tensor norms come from one fused multi-tensor kernel per (device, dtype) and their
    norm is taken exactly as ``clip_grad_norm_`` takes it, so the value reproduces the
    clipping norm (three kernels in all). Non-finite elements propagate. ``kinds``:
    ``norm_kinds(grads)``, where the caller keeps it from step to step.
    """
    kinds = norm_kinds(grads) if kinds is None else kinds
    first = grads[0].device
    if len(kinds) == 1:
        norms = list(torch._foreach_norm(list(grads), 2.0))
    else:  # clip_grad_norm_'s grouping; scatter back into parameter order
        norms = [None] * len(grads)  # type: ignore[list-item]
        for indices in kinds:
            for i, n in zip(indices, torch._foreach_norm([grads[i] for i in indices], 2.0)):
                norms[i] = n.to(first, torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0, dim=0, keepdim=True)
    if inv_scale is not None:
        total = total.to(F64) * inv_scale
    return total  # float32 is fine: the step's one ``cat`` promotes every part to float64


def inverse_scale(scaler: Any, scale: Any) -> Any:
    """1/s for gradients still multiplied by a loss scale s; None when already unscaled.

    ``scale``: an explicit float or tensor. ``scaler``: a ``torch.amp.GradScaler``; its
    scale tensor is read without a host sync, and nothing is divided once ``unscale_``
    has run for the monitored optimizer (or when the scaler is disabled).
    """
    if scale is not None:
        if isinstance(scale, torch.Tensor):
            return scale.detach().to(F64).reciprocal()
        return 1.0 / scale
    if scaler is None or not scaler.is_enabled():
        return None
    from torch.amp.grad_scaler import OptState

    for state in getattr(scaler, "_per_optimizer_states", {}).values():
        if state.get("stage") is OptState.UNSCALED:
            return None
    scale_tensor = getattr(scaler, "_scale", None)
    return None if scale_tensor is None else scale_tensor.detach().to(F64).reciprocal()


def amp_skipped(scaler: Any, scale_before: torch.Tensor) -> torch.Tensor:
    """1.0 (float64 [1], on the scale's device, no host sync) when ``scaler`` (a
    ``torch.amp.GradScaler``) skipped this step's optimizer step for inf/NaN gradients, else
    0.0: before ``update()``, any ``found_inf`` of the optimizers it unscaled; after it, the
    scale fell below ``scale_before`` (``update`` backs off only after a skip)."""
    found = [
        flag.to(scale_before.device, F64).reshape(1)
        for state in getattr(scaler, "_per_optimizer_states", {}).values()
        for flag in state.get("found_inf_per_device", {}).values()
    ]
    if found:
        return (torch.cat(found).sum(0, keepdim=True) > 0).to(F64)
    return (scaler._scale.detach().to(F64).reshape(1) < scale_before).to(F64)


def clip_threshold(configured: float | None, max_norm: float | None) -> float | None:
    """c behind grad.clipped and sent as grad.clip_threshold (seeds 001 §4): the ``max_norm``
    the loop clipped with this step (``clip_grad_norm_``, or ``clipped(norm, max_norm=)``),
    else ``ProbeConfig.clip_threshold``; None: neither is known, nothing is derived. Where
    both are given and differ, the loop's ``max_norm`` is what clipped, so it is c."""
    return configured if max_norm is None else max_norm


# ------------------------------------------------------------------ host decoding
def _indicator(value: float, threshold: float) -> float:
    return math.nan if math.isnan(value) else float(value > threshold)


def decode_norms(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    """[‖g‖] with meta = the clip threshold to derive grad.clipped from, or None."""
    values, threshold = parts[0]
    total = float(values[0])
    out = [Point(Grad.NORM_SQ, total * total)]
    if threshold is not None:  # this rank's sum is the global G2
        out.append(Point(Grad.CLIPPED, _indicator(total, threshold)))
    return out


def decode_clipped(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    """[the loop's own norm] with meta = the clip threshold, or None: grad.clip_norm, and
    grad.clipped when the threshold is known."""
    values, threshold = parts[0]
    norm = float(values[0])
    out = [Point(Grad.CLIP_NORM, norm)]
    if threshold is not None:
        out.append(Point(Grad.CLIPPED, _indicator(norm, threshold)))
    return out


def decode_grad_detail(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    """Gradient scan rows combined by group: the unlabelled totals and one set per group
    present; meta (each row's group, groups present, scan width). Every field adds except
    ABS_MAX, the maximum. Each group also gets its grad.norm_sq from the scans' Σg² (finite
    elements; the unlabelled grad.norm_sq is the clipping norm)."""
    values, (row_groups, present, width) = parts[0]
    rows = values.reshape(-1, width)
    of_row = np.asarray(row_groups, dtype=np.int64)
    out = []
    for labels, selected in (((), rows), *((_GROUP_LABELS[g], rows[of_row == g]) for g in present)):
        combined = selected.sum(axis=0)
        combined[ScanFields.ABS_MAX] = selected[:, ScanFields.ABS_MAX].max(initial=0.0)
        v = combined.tolist()
        out += [Point(name, v[f], labels) for name, f in _DETAIL]
        if labels:
            out.append(Point(Grad.NORM_SQ, v[ScanFields.SUM_SQ], labels))
    return out


def _group_rows(gathered: GroupScan, inv_scale: Any) -> torch.Tensor:
    rows = gathered.rows()
    return rows if inv_scale is None else scale_scan(rows, inv_scale)


def _late_detail(
    finish: Callable[[], torch.Tensor], row_groups: list[int], present: tuple[int, ...]
) -> list[Point]:
    """``decode_grad_detail`` of rows reduced here, on the emitter thread."""
    rows = finish()
    return decode_grad_detail([(rows.numpy().reshape(-1), (row_groups, present, rows.shape[1]))])


# ------------------------------------------------------------------ the probe
@dataclass(frozen=True, slots=True)
class _Plan:
    """``record``'s per-tensor bookkeeping for one set of gradients present: a model's
    gradients keep their parameters, sizes and groups from step to step."""

    present: tuple[int, ...] | None  # indices of the owned parameters with a gradient; None: all
    infos: tuple[ParamInfo, ...]  # their parameters
    groups: tuple[int, ...]  # the groups present, sorted
    scan: GroupPlan  # which gradients are scanned whole, which copied where
    kinds: tuple[tuple[int, ...], ...]  # their indices by (device, dtype), for ``grad_norms``


@dataclass(frozen=True, slots=True)
class _Clipped:
    """What ``clip_grad_norm_`` needs to know of the parameters it is given, once per list."""

    ids: tuple[int, ...]
    owned_in_order: bool  # exactly the owned parameters, in their order: one read of .grad
    owned: bool  # the owned parameters, in any order
    plain: bool  # no DTensor among them


class GradProbe:
    """The rank's gradient measurements; the probe sets in ``listeners`` (the structure
    probes, a user's own) hear about the gradient point too (``on_gradients``)."""

    def __init__(
        self,
        params: Sequence[ParamInfo],
        tensors: TensorProbe,
        listeners: list,
        *,
        clip_threshold: float | None,
        whole_gradient: bool,
    ) -> None:
        self._params = [info for info in params if info.owned]
        self._owned = [info.param for info in self._params]
        self._owned_ids = tuple(map(id, self._owned))
        self._sharded = any(is_dtensor(p) for p in self._owned)
        self._tensors = tensors
        self._listeners = listeners
        self._threshold = clip_threshold
        self._mismatch_told = False  # the config's threshold differs from the loop's: said once
        self._whole = whole_gradient
        self._plans: dict[tuple[int, ...], _Plan | None] = {}  # by the indices without a gradient
        self._clipped: _Clipped | None = None

    def _plan(self, grads: list[torch.Tensor | None]) -> _Plan | None:
        """The plan of the gradients present in ``grads`` (None: no gradient at all)."""
        # C-level passes: a step's per-tensor Python is what 1,000 tensors make costly
        absent = any(map(operator.is_, grads, itertools.repeat(None)))
        missing = tuple(i for i, g in enumerate(grads) if g is None) if absent else ()
        if missing in self._plans:
            return self._plans[missing]
        if len(self._plans) >= 16:  # gradients that come and go from step to step
            self._plans.clear()
        gone = frozenset(missing)
        present = [i for i in range(len(grads)) if i not in gone]
        infos = tuple(self._params[i] for i in present)
        groups = [info.group for info in infos]
        shards = [local(grads[i]) for i in present]
        plan = (
            _Plan(
                tuple(present) if missing else None,
                infos,
                tuple(sorted(set(groups))),
                self._tensors.plan_groups(shards, groups),
                norm_kinds(shards),
            )
            if present
            else None
        )
        self._plans[missing] = plan
        return plan

    def record(
        self,
        state: StepState,
        scaler: Any,
        scale: Any,
        *,
        norm: bool = True,
        detail: bool = True,
        notify: bool = True,
        grads: list[torch.Tensor | None] | None = None,
    ) -> None:
        """Measure now: call after the last backward, before clipping. ``grads``: the
        ``.grad`` of every owned parameter in order, where the caller has just read them."""
        if not state.sampled:
            return
        if grads is None:
            grads = [p.grad for p in self._owned]
        plan = self._plan(grads)
        if plan is None:
            return
        if plan.present is not None:
            grads = [grads[i] for i in plan.present]
        inv = inverse_scale(scaler, scale)
        if scaler is not None and scaler.is_enabled() and state.scaler is None:
            state.scaler = (scaler, scaler._scale.detach().to(F64).reshape(1))  # a copy
        if notify:
            for listener in self._listeners:
                listener.on_gradients(state, inv)
        with torch.no_grad():  # a create_graph gradient is measured, never differentiated
            if self._sharded:
                grads = [local(g) for g in grads]  # this rank's shard
            self._measure(state, plan, grads, inv, norm, detail)

    def _measure(
        self,
        state: StepState,
        plan: _Plan,
        grads: list[torch.Tensor],
        inv: Any,
        norm: bool,
        detail: bool,
    ) -> None:
        if state.due[NORM_TIER] and norm:
            state.g2 = grad_norms(grads, inv, plan.kinds)
        groups_due, tensors_due = detail and state.due[DETAIL_TIER], detail and state.due[SCAN_TIER]
        if tensors_due:  # a row per tensor (and fused part), combined by group too
            entries = []
            for info, grad in zip(plan.infos, grads):  # scanned now: the clip has not run yet
                entries += self._tensors.parameter_entries(
                    "grad", [(info.param, grad)], emit=True, group=info.group
                )
            rows = self._tensors.scan_entries(state, entries, inv)
            row_groups = [e.group for e in entries]
        elif groups_due:  # group totals only: each group's small tensors in one scan
            gathered = self._tensors.gather_groups(state, grads, plan.scan)
            finish = functools.partial(_group_rows, gathered, inv)
            # the small tensors are copies now (the clip runs next): on the host their
            # reductions run on the emitter thread, on a device they join the step's transfer
            rows, row_groups = (finish if gathered.on_host else finish()), gathered.row_groups
        else:
            return
        if groups_due:  # combined by group on the host (``decode_grad_detail``)
            state.grad_rows = (rows, row_groups, plan.groups)

    def _clip_params(self, params: list[torch.Tensor]) -> _Clipped:
        ids = tuple(map(id, params))
        if self._clipped is None or self._clipped.ids != ids:
            self._clipped = _Clipped(
                ids,
                ids == self._owned_ids,
                frozenset(ids) == frozenset(self._owned_ids),
                not any(is_dtensor(p) for p in params),
            )
        return self._clipped

    def clip_grad_norm_(
        self,
        state: StepState,
        parameters: Any,
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
    ) -> torch.Tensor:
        """Measure, then clip with the same total norm (see ``StepContext.clip_grad_norm_``)."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        every = [p.grad for p in params]
        grads = [g for g in every if g is not None]
        given = self._clip_params(params)
        # the clipping norm is this rank's one part of G2 (all its own gradients, 2-norm, not
        # sharded), or G2 is measured too: a subset, another norm, shards, replicas not counted
        same = (
            given.plain
            and norm_type == 2.0
            and (
                given.owned
                or self._owned_with_grad()
                == {id(p) for p, g in zip(params, every) if g is not None}
            )
        )
        self.record(
            state,
            None,
            None,
            norm=not same,  # before clipping
            grads=every if given.owned_in_order else None,
        )
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
        if is_dtensor(total):  # sharded gradients: the clip needs the global norm (as torchtitan)
            total = total.full_tensor()
        if state.due[NORM_TIER] and grads:
            state.clip, state.max_norm = total.detach(), float(max_norm)
            if same:
                state.g2 = state.clip
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def _owned_with_grad(self) -> set[int]:
        return {id(p) for p in self._owned if p.grad is not None}

    def clipped(
        self, state: StepState, total_norm: torch.Tensor | float, max_norm: float | None
    ) -> None:
        if state.due[NORM_TIER]:
            state.max_norm = None if max_norm is None else float(max_norm)
            if is_dtensor(total_norm):
                if not all(p.is_replicate() for p in total_norm.placements):
                    raise LayoutError(
                        "clipped(total_norm): pass total_norm.full_tensor(), the "
                        "global norm, not a Partial DTensor"
                    )
                total_norm = local(total_norm)
            state.clip = total_norm.detach() if isinstance(total_norm, torch.Tensor) else total_norm

    def _step_threshold(self, state: StepState) -> float | None:
        """``clip_threshold`` for this step; a config that disagrees with the loop is logged
        once (the loop's ``max_norm`` is what clipped, and it is what is sent)."""
        configured, given = self._threshold, state.max_norm
        if given is not None and configured not in (None, given) and not self._mismatch_told:
            self._mismatch_told = True
            log.warning(
                "probewire: ProbeConfig.clip_threshold=%r differs from the max_norm=%r "
                "the loop clips with; grad.clipped and grad.clip_threshold use max_norm "
                "(set clip_threshold to it, or leave it unset)",
                configured,
                given,
            )
        return clip_threshold(configured, given)

    def close(self, state: StepState, points: list[Point], late: list[Late]) -> None:
        threshold, collector = self._step_threshold(state), state.collector
        same = state.clip is state.g2  # the clipping norm is the measured one
        if state.g2 is not None:
            derive = threshold if (same or (state.clip is None and self._whole)) else None
            collector.add("grad.norms", state.g2, decode_norms, derive)
        if state.clip is not None and not same:  # the loop's own norm: G2 audits it
            if isinstance(state.clip, torch.Tensor):
                collector.add("grad.clip", state.clip, decode_clipped, threshold)
            else:
                points += decode_clipped([(np.array([float(state.clip)]), threshold)])
        if state.grad_rows is not None:
            rows, row_groups, present = state.grad_rows
            if callable(rows):  # reduced on the emitter thread
                late.append(functools.partial(_late_detail, rows, row_groups, present))
            else:
                collector.add(
                    "grad.detail", rows, decode_grad_detail, (row_groups, present, rows.shape[1])
                )
