"""Device-side probe arithmetic: small float64 vectors, no host synchronisation.

Every function here returns a tensor on the input's device and never calls ``.item()``,
``.cpu()`` or indexes with a boolean mask (no data-dependent shapes). The monitor stacks
the results of a step and copies them to the host once (``collect``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .scan import ScanFields, scan

__all__ = ["adamw_chain", "grad_norms", "host_values", "inverse_scale", "loss_components",
           "masked_scan", "output_head", "output_top2", "scale_scan", "split_parts", "to_device"]

F64 = torch.float64


def host_values(values: Sequence[float] | Sequence[int], device: torch.device,
                dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host-built tensor on ``device`` without a host synchronisation: on CUDA it
    is staged in pinned memory and copied asynchronously (a copy from pageable memory
    would wait for the stream)."""
    t = torch.tensor(list(values), dtype=dtype)
    if device.type != "cuda":
        return t if device.type == "cpu" else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor goes to CUDA through pinned memory, asynchronously."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


def _expand_ids(ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Token ids broadcast to ``like``'s shape."""
    while ids.dim() < like.dim():
        ids = ids.unsqueeze(-1)
    return ids.expand_as(like)


def loss_components(losses: torch.Tensor, mask: torch.Tensor | None,
                    ids: Sequence[tuple[torch.Tensor | None, int]], n_labels: int
                    ) -> tuple[list[torch.Tensor], tuple]:
    """Per-row loss sums and valid counts of one micro-batch, float64 (seeds 001 §3).

    ``losses`` are per-token NLL values [B, ...] (a 1-D tensor is one row), ``mask`` the
    valid-target mask of the same shape (None: all valid). ``ids`` pairs an id tensor with
    the label offset of its registry (sources first, then modalities): row ids [B] are
    sent as they are and grouped on the host; token ids (the losses' shape) are reduced
    on the device. Masked positions are replaced by 0 first, so a NaN at a padded position
    cannot leak in. Returns the tensors (three kernels for row ids) and their layout (rows,
    row-id offsets, token-level, labels) for ``steps.loss_decoder``::

        [row sums (B), row counts (B), row ids (B) per row-id set, label sums (G),
         label counts (G) when token ids were given]
    """
    losses = losses.detach()
    rows = losses.shape[0] if losses.dim() >= 2 else 1
    values = losses if mask is None else torch.where(mask, losses, 0)
    flat2d = losses.dim() == 2  # [B, T]: row sums without a reshape
    parts = [(values if flat2d else values.reshape(rows, -1)).sum(-1, dtype=F64)]
    if mask is None:
        parts.append(torch.full((rows,), float(losses.numel() // rows), dtype=F64,
                                device=losses.device))
    else:  # an integer count: the step's cat promotes it to float64 exactly
        parts.append((mask if flat2d else mask.reshape(rows, -1)).sum(-1))
    row_offsets: list[int] = []
    token_ids: list[tuple[torch.Tensor, int]] = []
    for id_tensor, offset in ids:
        if id_tensor is None or not n_labels:
            continue
        if id_tensor.dim() == 1 and id_tensor.shape[0] == rows and losses.dim() >= 2:
            parts.append(to_device(id_tensor, losses.device))
            row_offsets.append(offset)
        else:
            token_ids.append((id_tensor, offset))
    if token_ids:
        flat_values = values.reshape(-1).to(F64)
        flat_mask = (mask.reshape(-1).to(F64) if mask is not None
                     else torch.ones_like(flat_values))
        sums = torch.zeros(n_labels, dtype=F64, device=losses.device)
        counts = torch.zeros(n_labels, dtype=F64, device=losses.device)
        for id_tensor, offset in token_ids:
            index = _expand_ids(to_device(id_tensor, losses.device), losses).reshape(-1)
            if mask is not None:
                index = torch.where(mask.reshape(-1), index, 0)
            if offset:
                index = index + offset
            sums.index_add_(0, index, flat_values)
            counts.index_add_(0, index, flat_mask)
        parts += [sums, counts]
    return parts, (rows, tuple(row_offsets), bool(token_ids), n_labels)


def grad_norms(grads: Sequence[torch.Tensor], inv_scale: torch.Tensor | float | None
               ) -> torch.Tensor:
    """``‖g‖`` over all gradient elements, loss scale removed (seeds 001 §4), shape [1].

    Per-tensor norms come from one fused multi-tensor kernel per (device, dtype) and their
    norm is taken exactly as ``clip_grad_norm_`` takes it, so the value reproduces the
    clipping norm (three kernels in all). Non-finite elements propagate. Per-group squared
    norms come from the P1 scans instead.
    """
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, g in enumerate(grads):
        by_kind.setdefault((g.device, g.dtype), []).append(i)
    first = grads[0].device
    if len(by_kind) == 1:
        norms = list(torch._foreach_norm(list(grads), 2.0))
    else:  # clip_grad_norm_'s grouping; scatter back into parameter order
        norms = [None] * len(grads)  # type: ignore[list-item]
        for indices in by_kind.values():
            for i, n in zip(indices, torch._foreach_norm([grads[i] for i in indices], 2.0)):
                norms[i] = n.to(first, torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0, dim=0, keepdim=True)
    if inv_scale is not None:
        total = total.to(F64) * inv_scale
    return total  # float32 is fine: the step's one ``cat`` promotes every part to float64


def scale_scan(vec: torch.Tensor, inv_scale: torch.Tensor | float) -> torch.Tensor:
    """The scan vector of ``x·inv_scale`` from the scan vector of ``x`` (loss-scale removal)."""
    powers = [1.0, 1.0, 2.0, 1.0, 1.0, 0.0, 0.0, 3.0, 4.0][: vec.shape[-1]]
    exps = host_values(powers, vec.device, F64)
    factor = (inv_scale.to(F64) if isinstance(inv_scale, torch.Tensor)
              else torch.full((), float(inv_scale), dtype=F64, device=vec.device))
    multiplier = factor.pow(exps)
    multiplier[ScanFields.N] = 1.0
    return vec * multiplier


def masked_scan(x: torch.Tensor, mask: torch.Tensor | None, mask_count: torch.Tensor | None,
                *, moments: bool, chunk_elems: int | None) -> torch.Tensor:
    """Scan vector of ``x``; of its valid positions when its leading dims are the mask's.

    Padded positions are replaced by exact zeros before the scan, then N becomes
    valid positions × features and the zeros they added are subtracted again.
    """
    x = x.detach()
    if (mask is None or x.dim() < mask.dim() or tuple(x.shape[: mask.dim()]) != tuple(mask.shape)
            or x.numel() == 0):
        return scan(x, moments=moments, chunk_elems=chunk_elems)
    features = x.numel() // mask.numel()
    shaped = mask.reshape(*mask.shape, *([1] * (x.dim() - mask.dim())))
    vec = scan(torch.where(shaped, x, 0), moments=moments, chunk_elems=chunk_elems)
    count = mask.sum(dtype=F64) if mask_count is None else mask_count
    vec[ScanFields.N] = count * features
    vec[ScanFields.ZEROS] -= (mask.numel() - count) * features
    return vec


def split_parts(x: torch.Tensor, n_parts: int, dim: int) -> tuple[torch.Tensor, ...] | None:
    """Equal parts of a fused projection's tensor along ``dim``; None when not divisible."""
    if x.dim() == 0 or x.shape[dim] % n_parts:
        return None
    return torch.chunk(x, n_parts, dim=dim)


HOST_REDUCE_POSITIONS = 8192
"""Up to this many positions per micro-batch, ``output_head`` ships its per-position rows
and the host reduces them (fewer kernels); above it the device reduces them to 4 values."""


def output_head(logits: torch.Tensor, mask: torch.Tensor | None
                ) -> tuple[list[torch.Tensor], tuple]:
    """Output-logit components over valid positions of logits z [..., V] (002, 001 §6).

    Per position: max z, min z and ‖z‖ over the vocabulary (three row reductions). For a
    small micro-batch the rows and the mask are returned as they are (meta "rows"); for a
    large one they are masked and reduced on the device to [max z, max −z, ‖z‖, positions]
    (meta "reduced"). The host forms max |z| and Σ z² (``steps.decode_head``). NaN and ±Inf
    propagate on purpose: an overflow at the output must show as a non-finite measurement.
    """
    vocab = logits.shape[-1]
    masked = mask is not None and tuple(logits.shape[:-1]) == tuple(mask.shape)
    z = logits.detach().reshape(-1, vocab)  # positions × vocabulary: 1-D row statistics
    positions = z.shape[0]
    top, bottom = z.amax(-1), z.amin(-1)
    norms = torch.linalg.vector_norm(z, dim=-1, dtype=torch.float32)
    if positions <= HOST_REDUCE_POSITIONS:
        rows = [top, bottom, norms, mask.reshape(-1)] if masked else [top, bottom, norms]
        return rows, ("rows", positions, masked, vocab)
    mask = mask.reshape(-1) if masked else None
    stacked = torch.stack([top, bottom.neg_(), norms])
    if masked:
        stacked = torch.where(mask, stacked, 0)
        count = mask.sum(dtype=F64).reshape(1)
    else:
        count = torch.full((1,), float(positions), dtype=F64, device=z.device)
    return ([stacked[:2].amax(dim=1), torch.linalg.vector_norm(stacked[2], dim=0, keepdim=True),
             count],
            ("reduced", positions, masked, vocab))


def output_top2(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``[positions, Σ (z_(1) − z_(2)), Σ 1[z_(1) = z_(2)]]`` over valid positions (002)."""
    z = logits.detach()
    top = z.topk(2, dim=-1).values.to(torch.float32)
    gap = top[..., 0] - top[..., 1]
    if mask is not None and tuple(gap.shape) == tuple(mask.shape):
        valid = mask
        gap = torch.where(mask, gap, 0)
        positions = mask.sum(dtype=F64)
    else:
        valid = torch.ones_like(gap, dtype=torch.bool)
        positions = torch.full((), float(gap.numel()), dtype=F64, device=z.device)
    ties = (valid & (top[..., 0] == top[..., 1])).sum(dtype=F64)
    return torch.stack([positions, gap.to(F64).sum(), ties])


def adamw_chain(param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
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
