"""A run's held-out loss against tokens or FLOPs: fit, then predict with bounds.

Outside the fitted range a prediction is reported as an interval, never only a point
(seeds 001 §10); the fit and its bootstrap are ``scores.fit_scaling``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from numpy.typing import ArrayLike

from .scores import ScalingFit, fit_scaling

__all__ = ["ScalingPrediction", "ScalingReport", "scaling_report"]


@dataclass(kw_only=True, slots=True, frozen=True)
class ScalingPrediction:
    x: float
    low: float
    point: float
    high: float
    extrapolated: bool  # x lies outside [fit.x_min, fit.x_max]


@dataclass(kw_only=True, slots=True, frozen=True)
class ScalingReport:
    fit: ScalingFit
    confidence: float
    predictions: tuple[ScalingPrediction, ...]

    def lines(self) -> list[str]:
        """Human-readable summary, one line per prediction after the fitted law."""
        f = self.fit
        out = [
            f"L(x) = {f.a:.4g} + {f.b:.4g}·x^(-{f.alpha:.4g}) on x in "
            f"[{f.x_min:.4g}, {f.x_max:.4g}] ({f.n_points} points)"
        ]
        for p in self.predictions:
            tag = "extrapolated" if p.extrapolated else "interpolated"
            out.append(
                f"x={p.x:.4g}: {p.point:.4g} in [{p.low:.4g}, {p.high:.4g}] "
                f"({self.confidence:.0%}, {tag})"
            )
        return out


def scaling_report(
    x: ArrayLike,
    loss: ArrayLike,
    predict_at: Sequence[float],
    *,
    confidence: float = 0.9,
    seed: int = 0,
) -> ScalingReport:
    """Fit L(x) = a + b·x^(−α) to (x, loss) and bound L at each ``predict_at`` value.

    ``x`` is cumulative tokens or FLOPs (the ``tokens``/``flops`` of eval records) and
    ``loss`` the matching held-out NLL or BPB of one weights stream.
    """
    fit = fit_scaling(x, loss, seed=seed)
    predictions = []
    for target in predict_at:
        low, point, high = fit.predict_bound(float(target), confidence)
        predictions.append(
            ScalingPrediction(
                x=float(target),
                low=low,
                point=point,
                high=high,
                extrapolated=not fit.x_min <= float(target) <= fit.x_max,
            )
        )
    return ScalingReport(fit=fit, confidence=confidence, predictions=tuple(predictions))
