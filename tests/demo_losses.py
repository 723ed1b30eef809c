"""The demo model's training loss, for tests that train it outside the demo loop (the
loop itself, ``deploy/demo/train.py``, computes it inline with the MTP heads' terms)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from probewire.deploy.demo.model import IGNORE


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Σ over valid targets of the token NLL (nats); padded targets are IGNORE."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=IGNORE,
        reduction="sum",
    )
