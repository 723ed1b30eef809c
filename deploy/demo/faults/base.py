"""The fault base class and the helpers faults share (a leaf: the other fault modules
import it).

A fault acts on real training through a few hooks the demo loop calls (``on_batch``,
``on_step_start``, ``on_step_end``, ``replay_differs``); its class attributes state the
signature probewire should show (see ``faults``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from ..data import Batch
from ..model import IGNORE

__all__ = ["Fault", "FaultError"]


class FaultError(ValueError):
    """A --fault argument that cannot be parsed; the message says what is wrong."""


@dataclass(kw_only=True)
class Fault:
    """A fault starting at ``step``; subclasses override the hooks they need."""

    name: ClassVar[str]
    signal: ClassVar[str]  # the P0 signal that pages
    culprit: ClassVar[str]  # what `explain` names
    also_pages: ClassVar[tuple[str, ...]] = ()  # other P0 signals the same fault raises
    within: ClassVar[int] = 0  # the page comes at most this many steps after ``step``
    # what `probewire explain` at the paging step shows: a finding of this stage (and
    # signal, when given) that names explain_culprit(), scored moved when explain_moves
    explain_stage: ClassVar[str] = "gradient"
    explain_signal: ClassVar[str | None] = None
    explain_moves: ClassVar[bool] = True
    explain_gap: ClassVar[str] = ""  # why explain does not (yet) name the culprit
    demo_args: ClassVar[tuple[str, ...]] = ()  # train.py flags the signature needs
    presets: ClassVar[tuple[str, ...]] = ()  # model presets it applies to (): any; the
    #                                             first is the one `probewire demo` picks
    step: int = 100

    def check_preset(self, preset: str) -> None:
        """A FaultError when the fault needs a model structure ``preset`` lacks."""
        if self.presets and preset not in self.presets:
            raise FaultError(
                f"{self.name} needs a model with "
                f"{' or '.join(self.presets)} structure: run it with "
                f"--preset {self.presets[0]} (got --preset {preset})"
            )

    def expected_culprit(self) -> str:
        """What the paging alert names (signals with a single culprit); "" when the step
        itself is the culprit."""
        return ""

    def explain_culprit(self) -> str:
        """What explain's finding names; "" when only the finding's movement counts."""
        return self.expected_culprit()

    def on_batch(self, step: int, rank: int, batch: Batch) -> Batch:
        return batch

    def on_step_start(
        self, step: int, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        return None

    def on_step_end(self, step: int, rank: int) -> None:
        return None

    def replay_differs(self, step: int) -> bool:
        """Whether the spike guard's replay of ``step`` fails to reproduce its loss."""
        return False


def _scramble(batch: Batch, rows: torch.Tensor, generator: torch.Generator) -> Batch:
    """Replace the bytes of the selected rows with uniform random bytes (valid positions)."""
    tokens, targets = batch.tokens.clone(), batch.targets.clone()
    noise = torch.randint(0, 256, targets.shape, generator=generator)
    keep = targets == IGNORE
    new_targets = torch.where(keep | ~rows[:, None], targets, noise)
    tokens[:, 1:] = torch.where(rows[:, None], new_targets[:, :-1].clamp(min=0), tokens[:, 1:])
    return replace(batch, tokens=tokens, targets=new_targets)


def _core(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # the TinyLM inside DDP
