"""Tensor probes (seeds 001 §6): one-pass scans of activations, their gradients, parameters,
updates and (on demand) the optimizer chain, on scan steps.

Every observation becomes an ``Entry`` (``state``): a tensor the step owns — a copy or a
fresh result, so later in-place changes (clipping, the optimizer, an in-place activation,
``zero_grad``) cannot reach it — with its name and kind. At the step's end all entries are
scanned together (``batchscan.scan_many`` batches equal sizes across kinds and layers);
activations larger than ``SMALL_ELEMS`` are scanned at once instead of copied.
Activations are masked to valid positions: padded positions become exact zeros, then N
becomes valid positions × features and the zeros of the padding are taken off again.
Scan rows of one (tensor, kind) combine with one segment reduction; the decoder turns
each into the catalog's tensor.* points (``ScanFields`` index -> ``Tensor`` name).

Activation checkpointing (001 §11): a forward hook that fires inside backward is the
recomputation; it scans nothing. The backward probe needs the output gradients flow
through: in the original forward when it requires grad, else (reentrant checkpointing
runs the original forward under ``no_grad``) in the recomputation; a per-module count of
forwards that could not take a backward hook decides which.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..batchscan import SMALL_ELEMS, GroupPlan, GroupScan, gather_groups, plan_groups, scan_many
from ..catalog import Label, Tensor, Tier, tier_of
from ..collect import host_values
from ..parallel import local
from ..registry import ObservedModule, ParamInfo, Registry
from ..scan import ScanFields, fused_scan, scan
from ..state import Entry, StepState
from ..wire import Labels, Point
from .common import F64, first_tensor, recomputing

__all__ = ["TensorProbe", "adamw_chain", "masked_scan", "scale_scan", "scan_points", "split_parts"]

TIER = tier_of(*Tensor.ALL[:7])
MOMENTS_TIER = tier_of(Tensor.SUM3, Tensor.SUM4)
_FIELDS = {
    ScanFields.N: Tensor.N,
    ScanFields.SUM: Tensor.SUM,
    ScanFields.SUM_SQ: Tensor.SUM_SQ,
    ScanFields.SUM_ABS: Tensor.ABS_SUM,
    ScanFields.ABS_MAX: Tensor.ABS_MAX,
    ScanFields.ZEROS: Tensor.ZEROS,
    ScanFields.NONFINITE: Tensor.NONFINITE,
    ScanFields.SUM_CUBE: Tensor.SUM3,
    ScanFields.SUM_QUAD: Tensor.SUM4,
}
SCAN_NAMES: tuple[str, ...] = tuple(_FIELDS[f] for f in sorted(ScanFields))
"""The tensor.* name of each scan-vector field, in the vector's order."""


# ------------------------------------------------------------------ device arithmetic
def masked_scan(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    mask_count: torch.Tensor | None,
    *,
    moments: bool,
    chunk_elems: int | None,
    fused: bool = False,
) -> torch.Tensor:
    """Scan vector of ``x``; of its valid positions when its leading dims are the mask's.

    Padded positions are replaced by exact zeros before the scan, then N becomes
    valid positions × features and the zeros they added are subtracted again. ``fused``:
    the compiled one-pass scan (``scan.fused_scan``) where no moments are asked for.
    """
    x = x.detach()

    def scanned(t: torch.Tensor) -> torch.Tensor:
        if fused and not moments:
            return fused_scan(t)
        return scan(t, moments=moments, chunk_elems=chunk_elems)

    if (
        mask is None
        or x.dim() < mask.dim()
        or tuple(x.shape[: mask.dim()]) != tuple(mask.shape)
        or x.numel() == 0
    ):
        return scanned(x)
    features = x.numel() // mask.numel()
    shaped = mask.reshape(*mask.shape, *([1] * (x.dim() - mask.dim())))
    vec = scanned(torch.where(shaped, x, 0))
    count = mask.sum(dtype=F64) if mask_count is None else mask_count
    vec[ScanFields.N] = count * features
    vec[ScanFields.ZEROS] -= (mask.numel() - count) * features
    return vec


def scale_scan(vec: torch.Tensor, inv_scale: torch.Tensor | float) -> torch.Tensor:
    """The scan vector(s) of ``x·inv_scale`` from those of ``x`` (loss-scale removal)."""
    powers = [1.0, 1.0, 2.0, 1.0, 1.0, 0.0, 0.0, 3.0, 4.0][: vec.shape[-1]]
    exps = host_values(powers, vec.device, F64)
    factor = (
        inv_scale.to(F64)
        if isinstance(inv_scale, torch.Tensor)
        else torch.full((), float(inv_scale), dtype=F64, device=vec.device)
    )
    multiplier = factor.pow(exps)
    multiplier[ScanFields.N] = 1.0
    return vec * multiplier


def split_parts(x: torch.Tensor, n_parts: int, dim: int) -> tuple[torch.Tensor, ...] | None:
    """Equal parts of a fused projection's tensor along ``dim``; None when not divisible."""
    if x.dim() == 0 or x.shape[dim] % n_parts:
        return None
    return torch.chunk(x, n_parts, dim=dim)


def adamw_chain(
    param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """AdamW's normalized gradient and preconditioned direction after its step (001 §6, P2).

    With the post-step moments m_t, v_t and bias corrections b1 = 1 − β1^t, b2 = 1 − β2^t:
    normalized = g / (sqrt(v_t / b2) + ε)  (the current gradient, per-element normalized);
    direction  = (m_t / b1) / (sqrt(v_t / b2) + ε)  (before learning-rate scaling and
    decoupled weight decay; the applied update is measured separately as Δw).
    None when the state lacks the moments (e.g. the parameter has not been stepped).
    """
    if "exp_avg" not in state or "exp_avg_sq" not in state:
        return None
    beta1, beta2 = group["betas"]
    eps = group["eps"]
    step = state["step"]
    if isinstance(step, torch.Tensor) and step.device == grad.device:  # capturable
        t = step.to(F64)
        b1 = 1.0 - torch.pow(torch.full((), float(beta1), dtype=F64, device=grad.device), t)
        b2 = 1.0 - torch.pow(torch.full((), float(beta2), dtype=F64, device=grad.device), t)
    else:  # the step count lives on the host (the default): plain floats, no copy
        t = float(step)
        b1 = torch.full((), 1.0 - float(beta1) ** t, dtype=F64, device=grad.device)
        b2 = torch.full((), 1.0 - float(beta2) ** t, dtype=F64, device=grad.device)
    second = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
    denom = (second.to(torch.float32) / b2.to(torch.float32)).sqrt_().add_(eps)
    normalized = grad.to(torch.float32) / denom
    direction = state["exp_avg"].to(torch.float32) / b1.to(torch.float32) / denom
    return normalized, direction


def part_names(names: tuple[str, ...], x: torch.Tensor, dim: int) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the whole, or of each fused part along ``dim`` (``names`` = the
    whole's name, then the part names)."""
    pieces = split_parts(x, len(names) - 1, dim) if len(names) > 2 else None
    return list(zip(names[1:], pieces)) if pieces is not None else [(names[0], x)]


# ------------------------------------------------------------------ host decoding
def scan_points(values: Sequence[float], labels: Labels) -> list[Point]:
    """tensor.* points of one (reduced) scan vector; nothing for an empty tensor."""
    if not values[ScanFields.N]:
        return []
    return [Point(name, v, labels) for name, v in zip(SCAN_NAMES, values)]


def _combined(
    blocks: list[tuple[list[tuple[str, str]], torch.Tensor]],
) -> tuple[torch.Tensor, list[Labels], int]:
    """One row per distinct (tensor, kind): rows of the same key combine (sums add,
    ABS_MAX takes the maximum) in one segment reduction; flattened."""
    slots: dict[tuple[str, str], int] = {}
    index: list[int] = []
    for keys, _ in blocks:
        for key in keys:
            index.append(slots.setdefault(key, len(slots)))
    labels = [((Label.TENSOR, t), (Label.KIND, k)) for t, k in slots]
    stacked = torch.cat([rows for _, rows in blocks]) if len(blocks) > 1 else blocks[0][1]
    width = stacked.shape[1]
    if len(slots) == stacked.shape[0]:  # one observation per key, already in order
        return stacked.reshape(-1), labels, width
    at = host_values(index, stacked.device)
    out = torch.zeros(len(slots), width, dtype=stacked.dtype, device=stacked.device)
    out.index_add_(0, at, stacked)
    out[:, ScanFields.ABS_MAX] = torch.zeros(
        len(slots), dtype=stacked.dtype, device=stacked.device
    ).scatter_reduce_(0, at, stacked[:, ScanFields.ABS_MAX], "amax", include_self=True)
    return out.reshape(-1), labels, width


def _decode_scans(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    values, (labels, width) = parts[0]
    values = values.tolist()
    out: list[Point] = []
    for i, lab in enumerate(labels):
        out += scan_points(values[i * width : (i + 1) * width], lab)
    return out


# ------------------------------------------------------------------ the probe
class TensorProbe:
    """The tensor scans of one rank: module hooks (fwd/bwd), optimizer hooks (param, update,
    and on demand the AdamW chain), and the step-end batch scan."""

    def __init__(
        self,
        state: StepState,
        registry: Registry,
        *,
        chunk_elems: int | None,
        mask_activations: bool,
        update_ratio: bool,
        persistent_hooks: bool,
        fused: bool = False,
    ) -> None:
        self._state = state
        self._chunk = chunk_elems
        self._fused = fused  # large activations and gradient groups: the compiled one-pass scan
        self._mask_activations = mask_activations
        self._update_ratio = update_ratio
        self._persistent = persistent_hooks
        self._module_hooks = [
            (obs.module, self._forward_hook(obs)) for obs in registry.modules if obs.report
        ]
        self._names = {
            id(i.param): (i.name, *(f"{i.name}.{p}" for p in i.parts)) for i in registry.params
        }
        self.handles: list[Any] = []
        self._armed: list[Any] = []
        if persistent_hooks:
            self.handles += [m.register_forward_hook(h) for m, h in self._module_hooks]

    # -- step boundaries --------------------------------------------------------------
    def open(self, state: StepState) -> None:
        """Install the module hooks for a scan step (unless they stay installed)."""
        if state.due[TIER] and not self._persistent:
            self._armed = [m.register_forward_hook(h) for m, h in self._module_hooks]

    def disarm(self) -> None:
        """Remove the module hooks installed for this step."""
        for handle in self._armed:
            handle.remove()
        self._armed = []

    def close(self, state: StepState) -> None:
        """Scan the step's entries in one batch; combine every scan row into the step."""
        if state.entries:
            self.scan_entries(state, state.entries)
            state.entries = []
        if state.scan_rows:
            vec, labels, width = _combined(state.scan_rows)
            state.collector.add("tensor.scans", vec, _decode_scans, (labels, width))

    def remove(self) -> None:
        for handle in [*self.handles, *self._armed]:
            handle.remove()
        self.handles, self._armed = [], []

    # -- observations -----------------------------------------------------------------
    def observe(
        self,
        state: StepState,
        names: tuple[str, ...],
        kind: str,
        x: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> None:
        """An activation (fwd) or its gradient (bwd): deferred when small, else scanned now."""
        x = x.detach()
        fits = (
            mask is not None
            and x.dim() >= mask.dim()
            and tuple(x.shape[: mask.dim()]) == tuple(mask.shape)
            and x.numel() > 0
        )
        if fits:
            shaped = mask.reshape(*mask.shape, *([1] * (x.dim() - mask.dim())))
        for name, part in part_names(names, x, -1):
            if part.numel() > SMALL_ELEMS:
                vec = masked_scan(
                    part,
                    mask if fits else None,
                    state.mask_count(mask) if fits else None,
                    moments=state.due[MOMENTS_TIER],
                    chunk_elems=self._chunk,
                    fused=self._fused,
                )
                state.scan_rows.append(([(name, kind)], vec.unsqueeze(0)))
            elif fits:
                state.entries.append(
                    Entry(
                        name,
                        kind,
                        torch.where(shaped, part, 0),
                        (state.mask_count(mask), mask.numel()),
                    )
                )
            else:
                state.entries.append(Entry(name, kind, part.clone()))

    def parameter_entries(
        self,
        kind: str,
        tensors: Sequence[tuple[torch.Tensor, torch.Tensor]],
        emit: bool = True,
        group: int | None = None,
    ) -> list[Entry]:
        """Entries of parameter-side tensors ``(param, tensor)``, fused parts along dim 0."""
        out = []
        for param, tensor in tensors:
            for name, part in part_names(self._names[id(param)], tensor.detach(), 0):
                out.append(Entry(name, kind, part, None, emit, group))
        return out

    def scan_entries(
        self, state: StepState, entries: Sequence[Entry], inv_scale: Any = None
    ) -> torch.Tensor | None:
        """Scan ``entries`` together; add the emitted rows to the step; return all rows."""
        if not entries:
            return None
        rows = scan_many(
            [e.tensor for e in entries], moments=state.due[MOMENTS_TIER], chunk_elems=self._chunk
        )
        corrected = [(i, e.correction) for i, e in enumerate(entries) if e.correction is not None]
        if corrected:
            index = host_values([i for i, _ in corrected], rows.device)
            counts = torch.stack([c for _, (c, _) in corrected]).to(device=rows.device, dtype=F64)
            features = host_values(
                [entries[i].tensor.numel() / m for i, (_, m) in corrected], rows.device, F64
            )
            padded = host_values([float(m) for _, (_, m) in corrected], rows.device, F64) - counts
            rows[index, ScanFields.N] = counts * features
            rows[index, ScanFields.ZEROS] -= padded * features
        if inv_scale is not None:
            rows = scale_scan(rows, inv_scale)
        emitted = [i for i, e in enumerate(entries) if e.emit]
        if emitted:
            keys = [(entries[i].name, entries[i].kind) for i in emitted]
            state.scan_rows.append(
                (
                    keys,
                    rows
                    if len(emitted) == len(entries)
                    else rows[host_values(emitted, rows.device)],
                )
            )
        return rows

    def plan_groups(self, tensors: Sequence[torch.Tensor], groups: Sequence[int]) -> GroupPlan:
        """``batchscan.plan_groups`` in this probe's chunk size."""
        return plan_groups(tensors, groups, self._chunk)

    def gather_groups(
        self, state: StepState, tensors: Sequence[torch.Tensor], plan: GroupPlan
    ) -> GroupScan:
        """Rows to combine per group, half done (``batchscan.gather_groups``): the large
        tensors scanned, the small ones copied; nothing emitted per tensor."""
        return gather_groups(
            tensors,
            plan,
            moments=state.due[MOMENTS_TIER],
            chunk_elems=self._chunk,
            fused=self._fused,
        )

    # -- hooks --------------------------------------------------------------------------
    def _forward_hook(self, obs: ObservedModule) -> Callable:
        """fwd/bwd probes of one module (see the module docstring for recomputation)."""
        state = self._state
        names = (obs.name, *(f"{obs.name}.{part}" for part in obs.parts))
        key = obs.name
        masked = self._mask_activations

        def backward_probe(mask: torch.Tensor | None) -> Callable:
            def on_grad(grad: torch.Tensor) -> None:
                if state.due[TIER]:
                    self.observe(state, names, "bwd", grad, mask)

            return on_grad

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if not state.due[TIER]:
                return None
            out = first_tensor(output)
            if out is None:
                return None
            mask = state.mask if masked else None
            pending = state.pending_bwd
            if recomputing():  # recomputation inside backward: never a second fwd scan
                if out.requires_grad and pending.get(key, 0) > 0:
                    pending[key] -= 1
                    out.register_hook(backward_probe(mask))
                return None
            self.observe(state, names, "fwd", out, mask)
            if out.requires_grad:
                out.register_hook(backward_probe(mask))
            else:
                pending[key] = pending.get(key, 0) + 1
            return None

        return hook

    def optimizer_hooks(
        self, params: list[ParamInfo], optimizer: torch.optim.Optimizer
    ) -> tuple[Callable, Callable]:
        """Pre/post step hooks: kind=param before the step, kind=update (Δw) after it, and on
        steps where forensics are due too the AdamW chain (opt_grad, opt_normalized,
        opt_direction)."""
        state = self._state
        adam = isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam))
        group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        snapshots: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

        def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if not state.due[TIER]:
                return None
            snapshots.clear()
            before = [
                (info.param, local(info.param).detach().clone())
                for info in params
                if info.param.grad is not None
            ]  # the copy serves kind=param and Δw
            state.entries += self.parameter_entries("param", before)
            if self._update_ratio:
                snapshots.extend(before)
            return None

        def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if not state.due[TIER]:
                return None
            updates = [(p, local(p).detach() - before) for p, before in snapshots]
            snapshots.clear()
            state.entries += self.parameter_entries("update", updates)
            if not state.due[Tier.DEMAND]:
                return None
            chain: list[tuple[str, list]] = [
                ("opt_grad", []),
                ("opt_normalized", []),
                ("opt_direction", []),
            ]
            for info in params:
                p = info.param
                if p.grad is None:
                    continue
                grad = local(p.grad).detach()
                chain[0][1].append((p, grad.clone()))
                if adam:
                    moments = {
                        k: local(v) if isinstance(v, torch.Tensor) else v
                        for k, v in opt.state.get(p, {}).items()
                    }
                    parts = adamw_chain(p, grad, moments, group_of[id(p)])
                    if parts is not None:
                        chain[1][1].append((p, parts[0]))
                        chain[2][1].append((p, parts[1]))
            for kind, items in chain:
                state.entries += self.parameter_entries(kind, items)
            return None

        return pre, post
