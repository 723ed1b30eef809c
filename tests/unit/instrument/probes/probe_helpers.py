"""Helpers of the probe-home tests (imported by name: pytest puts this folder on the path)."""

from __future__ import annotations

import numpy as np
import torch


def host(tensors) -> np.ndarray:
    """What the step's one ``cat`` makes of a part: flattened, promoted to float64."""
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).numpy()


def f64(x: torch.Tensor) -> np.ndarray:
    """Exact float64 values of ``x`` (torch converts; bf16 has no NumPy dtype)."""
    return x.detach().to(torch.float64).numpy()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def padding_mask(t: int, n_pad: int) -> torch.Tensor:
    valid = torch.ones(t, dtype=torch.bool)
    valid[t - n_pad :] = False
    return valid


def ref_block(values: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[C, 5] token blocks: count, sum, p90, p99, max over the valid rows."""
    v = values.reshape(values.shape[0], -1)[valid]
    return np.stack(
        [
            np.full(v.shape[1], v.shape[0]),
            v.sum(0),
            np.quantile(v, 0.90, axis=0),
            np.quantile(v, 0.99, axis=0),
            v.max(0),
        ],
        axis=-1,
    )
