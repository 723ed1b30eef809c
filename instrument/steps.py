"""The step context the loop uses, and the decoders that turn host values into points.

Decoders run on the emitter thread after the one device-to-host copy. They implement the
"no measurement, never a zero" rule: a component whose count is 0 produces no point.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from .otlp import Point
from .registry import GRAD_GROUPS
from .scan import ScanFields

if TYPE_CHECKING:
    from .monitor import Monitor

__all__ = ["NullStepContext", "StepContext", "decode_clipped", "decode_grad_detail", "decode_head",
           "decode_norms", "decode_top2", "loss_decoder"]

Labels = tuple[tuple[str, str], ...]
_GROUP_LABELS: tuple[Labels, ...] = tuple((("group", g),) for g in GRAD_GROUPS)


class StepContext:
    """Marks one optimizer step; reused by its monitor. Every method is a no-op on a step
    where its probe is not sampled, so the loop never branches."""

    __slots__ = ("_m",)

    def __init__(self, monitor: "Monitor") -> None:
        self._m = monitor

    def __enter__(self) -> "StepContext":
        self._m._begin()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self._m._end(exc_type is None)
        return False

    @property
    def step(self) -> int | None:
        return self._m._step

    def sampled(self, priority: str) -> bool:
        return self._m.sampled(priority)

    def micro_batch(self, *, tokens: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, source: torch.Tensor | None = None,
                    modality: torch.Tensor | None = None) -> None:
        """Composition of the next forward pass: input ``tokens`` [B, T] (their count is the
        step's positions for flops.step), the valid-target ``mask`` [B, T] (bool), and
        ``source`` / ``modality`` ids (row [B] or token [B, T]) indexing the registered
        ``ProbeConfig.sources`` / ``modalities``. Stores references only: do not modify
        these tensors in place before the step's record is exported (the next step)."""
        m = self._m
        m._mask, m._source, m._modality = mask, source, modality
        if tokens is not None:
            m._positions += tokens.numel()
        elif mask is not None:
            m._positions += mask.numel()

    def loss(self, token_losses: torch.Tensor, mask: torch.Tensor | None = None, *,
             source: torch.Tensor | None = None, modality: torch.Tensor | None = None) -> None:
        """Per-token NLL of one micro-batch (``reduction="none"``); mask/ids default to the
        current ``micro_batch``'s."""
        self._m._record_loss(token_losses, mask, source, modality)

    def loss_totals(self, loss_sum: torch.Tensor | float, valid_tokens: torch.Tensor | int) -> None:
        """For fused losses that only return a sum: the micro-batch's Σ m·ℓ and Σ m."""
        self._m._record_totals(loss_sum, valid_tokens)

    def gradients(self, *, scaler: Any = None, scale: Any = None) -> None:
        """Measure the gradients now: after accumulation (call it after the last backward),
        loss scale removed (pass the ``GradScaler`` or the scale), before clipping."""
        self._m._record_gradients(scaler, scale)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` that is also the gradient probe: the P1 scans
        and the P0 norm are taken first (accumulated, unscaled — call it after
        ``GradScaler.unscale_`` — and not yet clipped), then the same total norm clips.
        One norm computation serves both, so grad.norm_sq is the clipping norm squared.
        Returns the total norm, as torch's does."""
        return self._m._clip_grad_norm(parameters, max_norm, norm_type, error_if_nonfinite)

    def clipped(self, total_norm: torch.Tensor | float) -> None:
        """The global norm the loop clipped with (``clip_grad_norm_``'s return value, a
        device tensor is fine): grad.clipped = 1[total_norm > clip_threshold]."""
        if self._m._p0_on:
            self._m._clip = total_norm

    def comm_wait(self, op: str, seconds: float) -> None:
        """This rank's exposed wait on collective ``op`` in this step, measured by the loop
        itself (a host float, seconds >= 0): for collectives the monitor's wrappers cannot
        see, such as DDP's bucketed gradient all-reduce timed by a comm hook (report it
        under an op name of its own, e.g. ``"ddp_allreduce"``). Sent as ``comm.wait_s{op}``
        with every step record this step emits (not only on P1 steps); calls for one op in
        one step add up, and add to what the wrappers timed for the same op name. The
        stream subtracts a rank's waits from its step time to tell a straggler from the
        ranks that wait for it."""
        seconds = _check_wait(op, seconds)
        m = self._m
        if m._p0_on or m._p1_on or m._p2_on:
            m._comm_reported[op] = m._comm_reported.get(op, 0.0) + seconds

    def skipped(self) -> None:
        """The spike guard skipped this step's update."""
        self._m._guard[0] += 1

    def replayed(self, *, reproduced: bool) -> None:
        """The step was replayed; ``reproduced`` False when the replay's loss differed."""
        self._m._guard[1] += 1
        if not reproduced:
            self._m._guard[2] += 1


class NullStepContext:
    """The disabled monitor's step: every method accepts the same arguments and does nothing."""

    __slots__ = ()
    step = None

    def __enter__(self) -> "NullStepContext":
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False

    def sampled(self, priority: str) -> bool:
        return False

    def micro_batch(self, **kwargs: Any) -> None:
        return None

    def loss(self, token_losses: Any, mask: Any = None, **kwargs: Any) -> None:
        return None

    def loss_totals(self, loss_sum: Any, valid_tokens: Any) -> None:
        return None

    def gradients(self, **kwargs: Any) -> None:
        return None

    def clipped(self, total_norm: Any) -> None:
        return None

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type,
                                              error_if_nonfinite)

    def comm_wait(self, op: str, seconds: float) -> None:
        _check_wait(op, seconds)

    def skipped(self) -> None:
        return None

    def replayed(self, *, reproduced: bool) -> None:
        return None


def _check_wait(op: Any, seconds: Any) -> float:
    """``comm_wait``'s arguments: a label-safe op name and a finite wait >= 0 (seconds)."""
    if not isinstance(op, str) or not op or op != op.strip() or any(c in op for c in "|="):
        raise ValueError(f"comm_wait: op must be a non-empty name without spaces at its ends, "
                         f"'|' or '=', got {op!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise ValueError(f"comm_wait({op!r}): seconds must be a host float, got {seconds!r}")
    value = float(seconds)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"comm_wait({op!r}): seconds must be finite and >= 0, got {value!r}")
    return value


# ------------------------------------------------------------------------------ decoders
# Each decoder gets ``parts``: one (values, meta) per micro-batch or call, values a float64
# NumPy view of the host buffer. Components are combined here, in float64, on the host.

def loss_decoder(label_points: Sequence[Labels]):
    """loss.sum / loss.tokens, unlabelled and per source or modality with tokens > 0."""
    n_labels = len(label_points)

    def decode(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
        totals: list[float] = []
        counts_all: list[float] = []
        sums = [0.0] * n_labels
        counts = [0.0] * n_labels
        for array, (rows, row_offsets, token_level, _) in parts:
            values = array.tolist()
            row_sums, row_counts = values[:rows], values[rows:2 * rows]
            totals += row_sums
            counts_all += row_counts
            for j, offset in enumerate(row_offsets):
                ids = values[(2 + j) * rows:(3 + j) * rows]
                for label, s, n in zip(ids, row_sums, row_counts):
                    sums[int(label) + offset] += s
                    counts[int(label) + offset] += n
            if token_level:
                for i in range(n_labels):
                    sums[i] += values[-2 * n_labels + i]
                    counts[i] += values[-n_labels + i]
        count = math.fsum(counts_all)
        if not count > 0:
            return []  # no valid token on this rank: no measurement, never a zero
        out = [Point("loss.sum", math.fsum(totals)), Point("loss.tokens", count)]
        for i, labels in enumerate(label_points):
            if counts[i] > 0:
                out += [Point("loss.sum", sums[i], labels), Point("loss.tokens", counts[i], labels)]
        return out

    return decode


def _indicator(value: float, threshold: float) -> float:
    return math.nan if math.isnan(value) else float(value > threshold)


def decode_norms(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    """[‖g‖] with meta = the clip threshold to derive grad.clipped from, or None."""
    values, threshold = parts[0]
    total = float(values[0])
    out = [Point("grad.norm_sq", total * total)]
    if threshold is not None:  # this rank's sum is the global G2
        out.append(Point("grad.clipped", _indicator(total, threshold)))
    return out


def decode_clipped(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    values, threshold = parts[0]
    return [Point("grad.clipped", _indicator(float(values[0]), threshold))]


_DETAIL = (("grad.abs_sum", ScanFields.SUM_ABS), ("grad.abs_max", ScanFields.ABS_MAX),
           ("grad.zeros", ScanFields.ZEROS), ("grad.elements", ScanFields.N),
           ("grad.nonfinite", ScanFields.NONFINITE))


def decode_grad_detail(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    """Rows [all, embedding, expert, other] of combined per-tensor gradient scans; meta
    (groups present, scan width). Each group also gets its grad.norm_sq from the scans'
    Σg² (finite elements; the unlabelled grad.norm_sq is the P0 measurement)."""
    values, (present, width) = parts[0]
    v = values.tolist()
    out = []
    for row, labels in ((0, ()), *((1 + g, _GROUP_LABELS[g]) for g in present)):
        base = row * width
        out += [Point(name, v[base + f], labels) for name, f in _DETAIL]
        if labels:
            out.append(Point("grad.norm_sq", v[base + ScanFields.SUM_SQ], labels))
    return out


def decode_head(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    """Per micro-batch either the rows [max z (P), min z (P), ‖z‖ (P), mask (P)?] or the
    device-reduced [max z, max −z, ‖z‖, positions]; meta (form, P, masked, vocab)."""
    maxima: list[float] = []
    sum_sq = positions = 0.0
    vocab = 1
    for values, (form, n, masked, vocab) in parts:
        if form == "rows":
            rows = values[:3 * n].reshape(3, n)
            if masked:
                rows = rows[:, values[3 * n:4 * n] != 0]
            count = rows.shape[1]
            if count:  # NumPy's max/min propagate NaN, as the definition wants
                maxima += [float(rows[0].max()), -float(rows[1].min())]
                sum_sq += float(np.dot(rows[2], rows[2]))
        else:
            count = float(values[3])
            if count:
                maxima += [float(values[0]), float(values[1])]
            sum_sq += float(values[2]) ** 2
        positions += count
    if not positions > 0:
        return []  # no valid position reached the head: no measurement
    abs_max = math.nan if any(math.isnan(m) for m in maxima) else max(maxima)
    return [Point("output.logits_abs_max", abs_max), Point("output.logits_sum_sq", sum_sq),
            Point("output.logits_n", positions * vocab)]


def decode_top2(parts: list[tuple[np.ndarray, Any]]) -> list[Point]:
    total = [0.0, 0.0, 0.0]
    for values, _ in parts:
        total = [a + b for a, b in zip(total, values.tolist())]
    if not total[0] > 0:
        return []
    return [Point("output.positions", total[0]), Point("output.top2_gap_sum", total[1]),
            Point("output.top2_equal", total[2])]
