"""Module and optimizer hooks, specialised per observation point at attach time.

Every hook's first line checks one monitor flag and returns on a step whose probes are
not sampled, before touching any tensor (001 §12, "gate early").

Activation checkpointing (001 §11, "duplicate recomputation"): a forward hook that fires
while the autograd engine is running a backward pass (``_current_graph_task_id() != -1``)
is a recomputation: ``torch.utils.checkpoint`` re-running the forward, reentrant or not.
Its activations were already scanned in the original forward, so it scans nothing. The
backward probe needs the output that gradients flow through: in the original forward
when it requires grad (non-reentrant checkpointing, plain autograd), else in the
recomputation (reentrant checkpointing runs the original forward under ``no_grad``); a
per-module count of forwards that could not take a backward hook decides which.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from .probes import adamw_chain
from .tensors import observe, parameter_entries

if TYPE_CHECKING:
    from .monitor import Monitor
    from .registry import ObservedModule, ParamInfo

__all__ = ["first_tensor", "forward_hook", "logits_hook", "optimizer_hooks"]

_graph_task_id = torch._C._current_graph_task_id


def first_tensor(output: Any) -> torch.Tensor | None:
    """The observed tensor of a module output: itself, the first floating tensor of a
    tuple/list, or ``.logits`` / ``.last_hidden_state`` of a model-output object."""
    if isinstance(output, torch.Tensor):
        return output if output.is_floating_point() else None
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and item.is_floating_point():
                return item
        return None
    for attr in ("logits", "last_hidden_state"):
        value = getattr(output, attr, None)
        if isinstance(value, torch.Tensor):
            return value
    return None


def forward_hook(monitor: "Monitor", obs: "ObservedModule") -> Callable:
    """fwd/bwd tensor probes of one module (see the module docstring for recomputation)."""
    names = (obs.name, *(f"{obs.name}.{part}" for part in obs.parts))
    pending = monitor._pending_bwd
    key = obs.name

    def backward_probe(mask: torch.Tensor | None) -> Callable:
        def on_grad(grad: torch.Tensor) -> None:
            if monitor._tensors_on:
                observe(monitor, names, "bwd", grad, mask)
        return on_grad

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if not monitor._tensors_on:
            return None
        out = first_tensor(output)
        if out is None:
            return None
        mask = monitor._mask if monitor._mask_activations else None
        if _graph_task_id() != -1:  # recomputation inside backward: never a second fwd scan
            if out.requires_grad and pending.get(key, 0) > 0:
                pending[key] -= 1
                out.register_hook(backward_probe(mask))
            return None
        observe(monitor, names, "fwd", out, mask)
        if out.requires_grad:
            out.register_hook(backward_probe(mask))
        else:
            pending[key] = pending.get(key, 0) + 1
        return None

    return hook


def logits_hook(monitor: "Monitor") -> Callable:
    """output.* probes on the logits module (P0 head statistics, P1 top-2)."""

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        if not monitor._p0_on:
            return None
        if _graph_task_id() != -1:  # recomputation: already measured in the forward
            return None
        z = first_tensor(output)
        if z is not None and z.dim() > 0 and z.shape[-1] >= 2:
            monitor._record_head(z)
        return None

    return hook


def optimizer_hooks(monitor: "Monitor", params: list["ParamInfo"],
                    optimizer: torch.optim.Optimizer) -> tuple[Callable, Callable]:
    """Pre/post step hooks: kind=param before the step, kind=update (Δw) after it, and on
    P2 steps the AdamW chain (opt_grad, opt_normalized, opt_direction)."""
    adam = isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam))
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    names = {id(info.param): (info.name, *(f"{info.name}.{p}" for p in info.parts))
             for info in params}
    snapshots: list[tuple[torch.nn.Parameter, torch.Tensor]] = []

    def pre(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not monitor._tensors_on:
            return None
        snapshots.clear()
        before = [(info.param, info.param.detach().clone()) for info in params
                  if info.param.grad is not None]  # the copy serves kind=param and Δw
        monitor._deferred += parameter_entries(names, "param", before)
        if monitor._update_ratio:
            snapshots.extend(before)
        return None

    def post(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not monitor._tensors_on:
            return None
        updates = [(p, p.detach() - before) for p, before in snapshots]
        snapshots.clear()
        monitor._deferred += parameter_entries(names, "update", updates)
        if not monitor._p2_on:
            return None
        chain: list[tuple[str, list]] = [("opt_grad", []), ("opt_normalized", []),
                                         ("opt_direction", [])]
        for info in params:
            p = info.param
            if p.grad is None:
                continue
            chain[0][1].append((p, p.grad.detach().clone()))
            if adam:
                parts = adamw_chain(p, p.grad.detach(), opt.state.get(p, {}), group_of[id(p)])
                if parts is not None:
                    chain[1][1].append((p, parts[0]))
                    chain[2][1].append((p, parts[1]))
        for kind, items in chain:
            monitor._deferred += parameter_entries(names, kind, items)
        return None

    return pre, post
