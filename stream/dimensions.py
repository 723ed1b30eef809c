"""The bounded dimensions of a tensor label: block index, role inside the block, expert.

A tensor label (``tensor`` on tensor.* points: a module or parameter name such as
``blocks.3.moe.experts.5.w1.weight``) is kept as it is — the explosion walk
(``localize``), ``explain`` and the dashboards key on it — and is already bounded per run
(``validate``: ``max_label_values`` distinct values of one label key; a model has one per
observation point, fixed at attach). Stage 2 writes each name a run reports once, the
first time, into ``tensor_names`` with these dimensions, so a query can group by layer,
role or expert without parsing names: the role (``moe.experts.w1.weight``) is the same
for every block and expert, so its set is the size of one block.
"""

from __future__ import annotations

import math
import re

from .localize import layer_of_tensor

__all__ = ["tensor_dimensions"]

_EXPERT = re.compile(r"(?:^|\.)experts?\.(\d+)(?=\.|$)")
BLOCK_ROLE = "block"
"""The role of a block's own output (the name is the block itself: ``blocks.3``)."""


def tensor_dimensions(tensor: str) -> tuple[int | None, str, int | None]:
    """(layer, role, expert) of a tensor label: the block index (None outside the blocks),
    the name inside the block with the expert index removed (the whole name outside the
    blocks), and the expert index (None when the tensor is not one expert's)."""
    depth, key = layer_of_tensor(tensor)
    inside = math.isfinite(depth) and depth >= 0
    rest = tensor[len(key) :].lstrip(".") if inside else tensor
    match = _EXPERT.search(rest)
    expert = int(match.group(1)) if match else None
    if match:
        head = rest[: match.start(1) - 1]  # up to "experts", without ".<index>"
        rest = head + rest[match.end(1) :]
    return (int(depth) if inside else None), (rest or BLOCK_ROLE), expert
