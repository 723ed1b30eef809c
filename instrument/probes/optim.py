"""The optimizer probe: the learning rate of each parameter group, a P0 series (optim.lr).

The rate is read in an optimizer step pre-hook, so it is the rate the step's update used
even when the loop steps a scheduler afterwards inside the same step context. A step
context in which the optimizer did not step (a skipped update) reports the groups' rates
as they are when the step closes. Host values only: a rate held in a CPU tensor is read
as a float; one on a device (a capturable optimizer) is not read (no host sync; logged
once).
"""

from __future__ import annotations

import functools
import logging
import numbers
from typing import Any

import torch

from ..catalog import Label, Optim, tier_of
from ..collect import Late
from ..state import StepState
from ..wire import Point

__all__ = ["OptimProbe", "group_label", "learning_rates"]

TIER = tier_of(Optim.LR)

log = logging.getLogger(__name__)


def group_label(index: int, group: dict[str, Any]) -> str:
    """A parameter group's label: its ``name`` entry when it has one, else its index."""
    name = group.get("name")
    return str(name) if isinstance(name, str) and name else str(index)


def learning_rates(optimizer: torch.optim.Optimizer) -> list[tuple[str, float]]:
    """``(label, lr)`` of every group whose rate is a host number (see the module doc)."""
    rates = []
    for i, group in enumerate(optimizer.param_groups):
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu" or lr.numel() != 1:
                continue
            lr = float(lr)
        if isinstance(lr, numbers.Real) and not isinstance(lr, bool):
            rates.append((group_label(i, group), float(lr)))
    return rates


def _rate_points(rates: list[tuple[str, float]]) -> list[Point]:
    return [Point(Optim.LR, lr, ((Label.PARAM_GROUP, label),)) for label, lr in rates]


class OptimProbe:
    """optim.lr per parameter group, for the steps where its tier is due."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        self._seen: list[tuple[str, float]] | None = None
        self._state: StepState | None = None
        if len(learning_rates(optimizer)) < len(optimizer.param_groups):
            log.warning(
                "probewire: optim.lr is not reported for parameter groups whose lr "
                "is a device tensor (reading it would synchronise the device)"
            )
        self._handle = optimizer.register_step_pre_hook(self._pre_step)

    def open(self, state: StepState) -> None:
        self._state = state if state.due[TIER] else None
        self._seen = None

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._state is not None and self._seen is None:
            self._seen = learning_rates(self._optimizer)

    def close(self, state: StepState, late: list[Late]) -> None:
        if state.due[TIER]:
            rates = self._seen if self._seen is not None else learning_rates(self._optimizer)
            late.append(functools.partial(_rate_points, rates))  # points made off the thread
        self._state, self._seen = None, None

    def remove(self) -> None:
        self._handle.remove()
