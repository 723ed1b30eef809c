"""Helpers every probe home shares: the observed tensor of a module output, and whether a
forward hook fires inside a backward pass (activation checkpointing's recomputation)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["F64", "first_tensor", "recomputing"]

F64 = torch.float64
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


def recomputing() -> bool:
    """True while the autograd engine runs a backward pass: a forward hook firing now is
    ``torch.utils.checkpoint`` re-running the forward (reentrant or not), whose
    activations were already measured in the original forward (001 §11)."""
    return _graph_task_id() != -1


def labels_of(*pairs: tuple[str, object]) -> tuple[tuple[str, str], ...]:
    """A point's labels from (catalog label key, value) pairs: string values, sorted by key."""
    return tuple(sorted((key, str(value)) for key, value in pairs))
