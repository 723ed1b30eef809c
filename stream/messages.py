"""The words of an alert: what moved, how, and its value in the unit a person reads it in.

Pure functions (no state, no I/O), shared by the stream's alert rows and the report.
"""

from __future__ import annotations

from .series import StepMetrics as SM

__all__ = ["alert_message", "describe_value", "what_moved"]

# signals whose value is a loss in nats per valid token; a ``gap`` finding of these carries
# the ratio to the mean loss L instead (L_max / L, L_source / L)
_LOSSES = {SM.loss, SM.loss_worst_rank, "loss_by_source", "loss_rank_shift"}
_RATIO_OF = {SM.loss_worst_rank: "L_max / L", "loss_by_source": "L_source / L"}


def what_moved(signal: str, kind: str) -> str:
    """``"loss spike"``; a kind that repeats its signal is said once (``"cospike"``)."""
    return signal if kind == signal else f"{signal} {kind}"


def describe_value(signal: str, kind: str, value: float | None) -> str:
    """The value with its unit: nats/token for a loss, ``× L (L_max / L)`` for a loss's gap
    to the mean, bits/byte for the held-out BPB, the bare number otherwise."""
    if value is None:
        return "n/a"
    if kind == "gap" and signal in _RATIO_OF:
        return f"{value:.4g}× L ({_RATIO_OF[signal]})"
    if signal in _LOSSES:
        return f"{value:.4g} nats/token"
    if signal == "heldout_bpb":
        return f"{value:.4g} bits/byte"
    return f"{value:.4g}"


def alert_message(
    signal: str,
    kind: str,
    step: int,
    value: float,
    baseline: float | None,
    z: float | None,
    culprit: str,
) -> str:
    """One line: ``"loss_worst_rank spike at step 130: 5.545 nats/token against baseline
    2.301 nats/token, z=41.0; carried by rank 2"``."""
    z_text = "" if z is None else f", z={z:.1f}"
    carried = f"; carried by {culprit}" if culprit else ""
    return (
        f"{what_moved(signal, kind)} at step {step}: {describe_value(signal, kind, value)}"
        f" against baseline {describe_value(signal, kind, baseline)}{z_text}{carried}"
    )
