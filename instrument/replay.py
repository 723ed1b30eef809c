"""Replay verdicts: does a step re-run on the same batch reproduce what the step measured?

A sampled step leaves behind a ``Kept`` record: references to the device tensors its loss
and gradient probes already made (per micro-batch row loss sums and valid counts, the
gradient norm G). Nothing is computed or copied for it; the rank holds the last
``ProbeConfig.replay_steps`` such records. ``Monitor.replay(t)`` re-runs step t under
dense probes; its own ``Kept`` is compared with step t's here:

- the valid-token counts must be equal (a different count is a different batch: the
  caller's mistake, refused);
- the loss sum Σ m·ℓ and the gradient norm G (when both runs measured it) must agree
  within ``rtol`` relative tolerance. The default, 0, is bit-exact: the same kernels on
  the same device with the same inputs give the same bits (deterministic algorithms).
  Two NaNs agree: a batch that makes NaN makes it again.

Reproduced → verdict ``"data"`` (the batch is the cause of what the step showed); not
reproduced → ``"hardware"`` (the device, or non-determinism in the step's kernels).
The host reads happen here, on the training thread, only when a step is replayed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["DATA", "HARDWARE", "Kept", "ReplayVerdict", "Totals", "judge", "totals"]

DATA = "data"
HARDWARE = "hardware"


class Kept(NamedTuple):
    """What a sampled step keeps to judge a replay of it: device references, read only on a
    replay. ``loss`` holds the loss probe's collector parts, one per micro-batch, whose first
    two tensors are the row loss sums and row valid counts; ``scanned`` says the step's scan
    tier was sent (a replay then sends no detail of its own). A tuple: made at every sampled
    step's end, on the training thread."""

    loss: Sequence[tuple[torch.Tensor, ...]]
    grad_norm: torch.Tensor | None
    scanned: bool


@dataclass(frozen=True, slots=True)
class Totals:
    """A step's loss sum Σ m·ℓ, valid tokens Σ m and gradient norm G (None: not measured)."""

    loss_sum: float
    tokens: float
    grad_norm: float | None


@dataclass(frozen=True, slots=True)
class ReplayVerdict:
    """The outcome of ``Monitor.replay(step)``: ``verdict`` is ``DATA`` or ``HARDWARE``."""

    step: int
    verdict: str
    original: Totals
    replayed: Totals
    rtol: float

    @property
    def reproduced(self) -> bool:
        return self.verdict == DATA


def totals(kept: Kept) -> Totals:
    """Host values of a ``Kept`` record (one read per tensor; exact float64 sums)."""
    sums: list[float] = []
    counts: list[float] = []
    for row_sums, row_counts, *_ in kept.loss:  # ``loss_components`` or a fused [sum, count]
        sums += row_sums.detach().double().cpu().reshape(-1).tolist()
        counts += row_counts.detach().double().cpu().reshape(-1).tolist()
    norm = (
        None
        if kept.grad_norm is None
        else float(kept.grad_norm.detach().double().cpu().reshape(-1)[0])
    )
    return Totals(math.fsum(sums), math.fsum(counts), norm)


def _agree(a: float, b: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or abs(a - b) <= rtol * abs(a)


def judge(step: int, original: Totals, replayed: Totals, rtol: float = 0.0) -> ReplayVerdict:
    """The verdict of a replay of ``step`` (see the module docstring). Raises ValueError when
    the replay measured no loss or saw another token count than the step."""
    if not rtol >= 0:
        raise ValueError(f"replay of step {step}: rtol must be >= 0, got {rtol!r}")
    if not replayed.tokens > 0:
        raise ValueError(
            f"replay of step {step}: no loss recorded; call s.loss (or "
            "s.loss_totals) in the replay as in the step"
        )
    if replayed.tokens != original.tokens:
        raise ValueError(
            f"replay of step {step}: {replayed.tokens:g} valid tokens, the step "
            f"had {original.tokens:g}; a replay must run the step's own batch"
        )
    same = _agree(original.loss_sum, replayed.loss_sum, rtol)
    if original.grad_norm is not None and replayed.grad_norm is not None:
        same = same and _agree(original.grad_norm, replayed.grad_norm, rtol)
    return ReplayVerdict(step, DATA if same else HARDWARE, original, replayed, float(rtol))
