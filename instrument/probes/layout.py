"""What the model-structure probes share within one step and one model call.

``StructureState`` holds, per step, the per-token values waiting for the step's quantile
pass (residual paths, top-k margins), the gates and routers already measured, whether the
gradient point ran, and pending value-gradient hooks of a recomputation; per model call,
the token ids, the valid-token masks (text, media) and the layouts derived from them, the
residual stream between a block's branches, and the main head's logits for MTP. The root
pre-hook starts a model call (``new_forward``); a new step is noticed by the step context's
(step, start time), so a replayed step starts fresh.

Sequence layout. With a media projector, the backbone sequence is [media tokens | text
tokens]: the projector's token mask [B, M] and the text mask [B, T] are concatenated for
activations of length M + T. Activations whose leading shape matches neither layout are
measured over every position.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..state import StepState

__all__ = ["StructureState"]


class StructureState:
    """Per-step and per-call state of the structure probes (see the module docstring)."""

    def __init__(self) -> None:
        self._key: tuple[int | None, float] | None = None
        self.new_step(None)
        self.new_forward(None, None, None)

    # ------------------------------------------------------------------ step
    def new_step(self, key: tuple[int | None, float] | None) -> None:
        self._key = key
        self.residual: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.margins: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.once: set[int] = set()  # gates / routers measured this step
        self.grads_done = False
        self.pending_values: dict[int, int] = {}

    def sync(self, state: StepState) -> None:
        """Start a new step's state when the step context opened a new step (or a replay)."""
        key = (state.step, state.t0)
        if key != self._key:
            self.new_step(key)

    def current(self, state: StepState) -> bool:
        return self._key == (state.step, state.t0)

    # ------------------------------------------------------------------ model call
    def new_forward(
        self, state: StepState | None, ids: torch.Tensor | None, attention_mask: Any
    ) -> None:
        mask = state.mask if state is not None else None
        text = mask if mask is not None and mask.dtype == torch.bool else None
        if text is None and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            text = attention_mask.bool()
        if text is not None and ids is not None and tuple(text.shape) != tuple(ids.shape):
            text = None
        self.ids, self.text = ids, text
        self.media: torch.Tensor | None = None
        self.layouts: dict[tuple[int, ...], torch.Tensor | None] = {}
        self.streams: dict[int, torch.Tensor] = {}
        self.main_logits: torch.Tensor | None = None

    def set_media(self, mask: torch.Tensor) -> None:
        self.media, self.layouts = mask, {}

    def layout(
        self, lead: tuple[int, ...], text: torch.Tensor | None, media_fill: bool
    ) -> torch.Tensor | None:
        """``text`` [B, T] laid out like an activation with leading shape ``lead``: [B, T],
        [B, M + T] (media positions ``media_fill``, or the media mask when True) or the
        flattened [B·L]; None when no layout fits."""
        media = self.media
        candidates = []
        if text is not None:
            candidates.append(text)
            if media is not None and media.shape[0] == text.shape[0]:
                head = media if media_fill else torch.zeros_like(media)
                candidates.append(torch.cat([head, text], dim=1))
        elif media is not None and media_fill:
            b = media.shape[0]
            total = math.prod(lead)
            length = lead[1] if len(lead) == 2 else (total // b if total % b == 0 else 0)
            if length > media.shape[1]:
                rest = media.new_ones((b, length - media.shape[1]))
                candidates.append(torch.cat([media, rest], dim=1))
        total = math.prod(lead)
        for c in candidates:
            if c.numel() == total and (len(lead) != 2 or tuple(c.shape) == tuple(lead)):
                return c.reshape(lead)
        return None

    def valid(self, lead: tuple[int, ...]) -> torch.Tensor | None:
        key = tuple(lead)
        if key not in self.layouts:
            self.layouts[key] = self.layout(key, self.text, True)
        return self.layouts[key]

    def valid_flat(self, x: torch.Tensor) -> torch.Tensor:
        valid = self.valid(tuple(x.shape[:-1]))
        if valid is None:
            return torch.ones(math.prod(x.shape[:-1]), dtype=torch.bool, device=x.device)
        return valid.reshape(-1).to(x.device)
