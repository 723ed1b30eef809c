"""Checkpoint evaluation scores (seeds 001 §10).

Pure functions on numbers the evaluator has already computed (token NLLs, option
NLLs, decoded strings, boxes): no model, no I/O. Each docstring states its formula.
NLLs are in nats throughout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "ChoiceResult",
    "Normalization",
    "ScalingFit",
    "bits_per_byte",
    "choice_accuracy",
    "choice_suite_version",
    "exact_match",
    "fit_scaling",
    "iou",
    "media_gain",
    "nll_and_ppl",
    "pass_at_k",
    "utf8_byte_count",
]

Normalization = Literal["none", "tokens", "bytes"]
_NORMALIZATIONS: tuple[str, ...] = get_args(Normalization)
_EXP_OVERFLOW = math.log(np.finfo(np.float64).max)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def nll_and_ppl(token_nlls: ArrayLike, mask: ArrayLike | None = None) -> tuple[float, float]:
    """Mean NLL over the valid tokens and its perplexity (seeds 001 §10).

    NLL = (1/M) Σ_k ℓ_k over the M tokens whose mask is true; PPL = exp(NLL)
    (inf if it overflows). ``mask`` has the shape of ``token_nlls`` and holds
    booleans or 0/1; padding must be masked out, never counted. Raises ValueError
    when M = 0: an empty set has no NLL, and reporting 0 would be a lie.
    """
    nlls = np.asarray(token_nlls, dtype=np.float64)
    if mask is None:
        valid = nlls.ravel()
    else:
        m = np.asarray(mask)
        if m.shape != nlls.shape:
            raise ValueError(f"mask shape {m.shape} != token_nlls shape {nlls.shape}")
        if m.dtype != np.bool_:
            if not np.isin(m, (0, 1)).all():
                raise ValueError("mask must hold booleans or 0/1 values")
            m = m.astype(np.bool_)
        valid = nlls[m]
    if valid.size == 0:
        raise ValueError("no valid tokens: NLL and perplexity are undefined")
    nll = float(valid.mean())
    ppl = math.inf if nll > _EXP_OVERFLOW else math.exp(nll)
    return nll, ppl


def utf8_byte_count(text: str) -> int:
    """N_byte of ``text``: the length of its UTF-8 encoding (seeds 001 §10).

    Count the source text the scored tokens cover, not the tokens: "é" is 2 bytes,
    "中" 3, most emoji 4. Lone surrogates cannot be encoded and raise.
    """
    return len(text.encode("utf-8"))


def bits_per_byte(total_nll_nats: float, n_bytes: int) -> float:
    """BPB = Σ_k ℓ_k / (N_byte · ln 2) (seeds 001 §10).

    ``total_nll_nats`` is the summed (not mean) NLL of the held-out tokens and
    ``n_bytes`` the UTF-8 bytes they cover (``utf8_byte_count``). Unlike token
    perplexity it does not depend on the tokenizer, so runs compare directly.
    """
    if not _is_int(n_bytes) or n_bytes <= 0:
        raise ValueError(f"n_bytes must be an int > 0, got {n_bytes!r}")
    if math.isnan(total_nll_nats) or total_nll_nats < 0:
        raise ValueError(f"total_nll_nats must be >= 0, got {total_nll_nats!r}")
    return float(total_nll_nats) / (n_bytes * math.log(2))


@dataclass(kw_only=True, slots=True, frozen=True)
class ChoiceResult:
    """Multiple-choice outcome: accuracy and the option picked per question."""

    accuracy: float
    n_correct: int
    predicted: tuple[int, ...]
    normalization: Normalization


def _option_scores(
    q: int, nlls: Sequence[float], lengths: Sequence[float] | None, normalization: str
) -> list[float]:
    if len(nlls) == 0:
        raise ValueError(f"question {q}: no options")
    if any(math.isnan(v) for v in nlls):
        raise ValueError(f"question {q}: NaN option NLL")
    if lengths is None:
        return [float(v) for v in nlls]
    if len(lengths) != len(nlls):
        raise ValueError(f"question {q}: {len(nlls)} option NLLs but {len(lengths)} lengths")
    if normalization == "none":
        return [float(v) for v in nlls]
    if any(not (n > 0) for n in lengths):
        raise ValueError(f"question {q}: option lengths must be > 0 for '{normalization}'")
    return [float(v) / float(n) for v, n in zip(nlls, lengths, strict=True)]


def choice_accuracy(
    option_nlls: Sequence[Sequence[float]],
    option_lengths: Sequence[Sequence[float]] | None,
    answers: Sequence[int],
    normalization: Normalization,
) -> ChoiceResult:
    """Accuracy = (1/Q) Σ_q 1[â_q = a_q], â_q = argmin_i s_{q,i} (seeds 001 §10).

    s_{q,i} is the summed NLL of option i given question q, divided by the
    option's length in tokens ("tokens") or UTF-8 bytes ("bytes"), or left as the
    raw sum ("none"; ``option_lengths`` may then be None). Ties go to the lowest
    index. Questions may have different numbers of options. Fix the normalisation
    for the life of a run and put it in the suite version (``choice_suite_version``).
    """
    if normalization not in _NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {_NORMALIZATIONS}, got {normalization!r}")
    n_q = len(option_nlls)
    if n_q == 0:
        raise ValueError("no questions: accuracy is undefined")
    if len(answers) != n_q:
        raise ValueError(f"{n_q} questions but {len(answers)} answers")
    if option_lengths is None and normalization != "none":
        raise ValueError(f"normalization '{normalization}' needs option_lengths")
    if option_lengths is not None and len(option_lengths) != n_q:
        raise ValueError(f"{n_q} questions but {len(option_lengths)} rows of option_lengths")
    predicted: list[int] = []
    n_correct = 0
    for q, nlls in enumerate(option_nlls):
        lengths = None if option_lengths is None else option_lengths[q]
        scores = _option_scores(q, nlls, lengths, normalization)
        answer = answers[q]
        if not _is_int(answer) or not 0 <= answer < len(scores):
            raise ValueError(f"question {q}: answer {answer!r} is not an option index")
        best = min(range(len(scores)), key=scores.__getitem__)  # first minimum wins ties
        predicted.append(best)
        n_correct += best == answer
    return ChoiceResult(
        accuracy=n_correct / n_q,
        n_correct=n_correct,
        predicted=tuple(predicted),
        normalization=normalization,
    )


def choice_suite_version(suite_version: str, normalization: Normalization) -> str:
    """Suite version with the option normalisation in it, e.g. "mc-v1+norm=bytes".

    Scores under different normalisations are different metrics (seeds 001 §10,
    comparability); the version string keeps them apart.
    """
    if normalization not in _NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {_NORMALIZATIONS}, got {normalization!r}")
    return f"{suite_version}+norm={normalization}"


def exact_match(
    prediction: str, reference: str, normalize: Callable[[str], str] | None = None
) -> bool:
    """1[f(prediction) = f(reference)], f = ``normalize`` or identity (seeds 001 §10).

    The post-processing f belongs to the task and is versioned with it.
    """
    if normalize is None:
        return prediction == reference
    return normalize(prediction) == normalize(reference)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k = 1 − C(n−c, k) / C(n, k) (seeds 001 §10).

    n samples of which c pass, k ≤ n. Exactly 1.0 when n − c < k. Evaluated as
    1 − Π_{i=n−c+1}^{n} (1 − k/i), which avoids huge binomials.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        if not _is_int(value):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if n - c < k:
        return 1.0
    miss_all = 1.0
    for i in range(n - c + 1, n + 1):
        miss_all *= 1.0 - k / i
    return 1.0 - miss_all


Box = Sequence[float]


def _check_box(name: str, box: Box) -> tuple[float, float, float, float]:
    if len(box) != 4:
        raise ValueError(f"{name} must be (x0, y0, x1, y1), got {box!r}")
    x0, y0, x1, y1 = (float(v) for v in box)
    if not all(math.isfinite(v) for v in (x0, y0, x1, y1)):
        raise ValueError(f"{name} has a non-finite coordinate: {box!r}")
    if x1 < x0 or y1 < y0:
        raise ValueError(f"{name} needs x1 >= x0 and y1 >= y0, got {box!r}")
    return x0, y0, x1, y1


def iou(box_a: Box, box_b: Box) -> float:
    """IoU = |P ∩ G| / |P ∪ G| for axis-aligned boxes (x0, y0, x1, y1) (seeds 001 §10).

    0 when the boxes do not overlap (touching edges included), 1 when identical.
    If the union has zero area (both boxes are points or segments) the result is
    1.0 for identical boxes and 0.0 otherwise.
    """
    ax0, ay0, ax1, ay1 = _check_box("box_a", box_a)
    bx0, by0, bx1, by1 = _check_box("box_b", box_b)
    inter = max(0.0, min(ax1, bx1) - max(ax0, bx0)) * max(0.0, min(ay1, by1) - max(ay0, by0))
    union = (ax1 - ax0) * (ay1 - ay0) + (bx1 - bx0) * (by1 - by0) - inter
    if union <= 0.0:
        return 1.0 if (ax0, ay0, ax1, ay1) == (bx0, by0, bx1, by1) else 0.0
    return inter / union


def media_gain(score_with: float, score_without: float) -> float:
    """Δ_media = Q_with − Q_without for one higher-is-better score (seeds 001 §10).

    Near 0 means the model answers from text priors and ignores the media input.
    """
    if math.isnan(score_with) or math.isnan(score_without):
        raise ValueError("media_gain of a NaN score")
    return float(score_with) - float(score_without)


# --- scaling fit -----------------------------------------------------------------

_GRID_POINTS = 201
_REFINE_STEPS = np.linspace(-1.0, 1.0, 21)
_REFINE_LEVELS = 7


def _solve_ab(log_u: np.ndarray, y: np.ndarray, alpha: np.ndarray) -> tuple[np.ndarray, ...]:
    """Least-squares a, b per column of y (n × B) for fixed α per column; plus SSE."""
    z = np.exp(-log_u[:, None] * alpha[None, :])
    zc = z - z.mean(axis=0)
    b = (zc * (y - y.mean(axis=0))).sum(axis=0) / (zc * zc).sum(axis=0)
    a = y.mean(axis=0) - b * z.mean(axis=0)
    sse = ((y - a - b * z) ** 2).sum(axis=0)
    return a, b, sse


def _fit_columns(
    log_u: np.ndarray, y: np.ndarray, lo: float, hi: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Profile least squares for every column: grid over α, then zoom in 10× per level."""
    cols = np.arange(y.shape[1])
    grid = np.linspace(lo, hi, _GRID_POINTS)
    sse = np.stack([_solve_ab(log_u, y, np.full(cols.size, g))[2] for g in grid])
    alpha = grid[np.argmin(sse, axis=0)]
    step = grid[1] - grid[0]
    for _ in range(_REFINE_LEVELS):
        cand = np.clip(alpha[None, :] + step * _REFINE_STEPS[:, None], lo, hi)
        sse = np.stack([_solve_ab(log_u, y, c)[2] for c in cand])
        alpha = cand[np.argmin(sse, axis=0), cols]
        step /= 10.0
    a, b, _ = _solve_ab(log_u, y, alpha)
    return a, b, alpha


@dataclass(kw_only=True, slots=True, frozen=True)
class ScalingFit:
    """L(x) = a + b·x^(−α) fitted on x in [x_min, x_max] (tokens or FLOPs).

    ``boot_*`` hold the residual-bootstrap refits that ``predict_bound`` uses.
    """

    a: float
    b: float
    alpha: float
    x_min: float
    x_max: float
    rss: float
    n_points: int
    boot_a: np.ndarray = field(repr=False, compare=False)
    boot_b: np.ndarray = field(repr=False, compare=False)
    boot_alpha: np.ndarray = field(repr=False, compare=False)

    def predict(self, x: float) -> float:
        """Point estimate a + b·x^(−α); use ``predict_bound`` outside the fitted range."""
        _check_positive("x", x)
        return self.a + self.b * math.exp(-self.alpha * math.log(x))

    def predict_bound(self, x_new: float, confidence: float = 0.9) -> tuple[float, float, float]:
        """(low, point, high) for L(x_new) (seeds 001 §10: bound, not point, outside the range).

        [q_lo, q_hi] are the (1 ∓ confidence)/2 quantiles of the bootstrap refits at
        x_new. With d = distance of log x_new outside [log x_min, log x_max] in units
        of the fitted log-span and f = 1 + d, the interval is
            low  = point − f·(point − q_lo)⁺ − (f − 1)·g
            high = point + f·(q_hi − point)⁺ + (f − 1)·g,
        g = |L̂(x_new) − L̂(nearest fitted edge)|. Inside the range f = 1 and this is
        the plain bootstrap interval; outside, both terms grow with distance, so the
        bound stays wide even when the data are noiseless. The widening is a stated
        allowance for the law bending beyond the data, not a calibrated guarantee.
        """
        _check_positive("x_new", x_new)
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
        point = self.predict(x_new)
        boot = self.boot_a + self.boot_b * np.exp(-self.boot_alpha * math.log(x_new))
        q_lo, q_hi = np.quantile(boot, [(1.0 - confidence) / 2.0, (1.0 + confidence) / 2.0])
        span = math.log(self.x_max / self.x_min)
        outside = max(0.0, math.log(x_new / self.x_max), math.log(self.x_min / x_new))
        widen = 1.0 + outside / span
        edge = min(max(x_new, self.x_min), self.x_max)
        gain = abs(point - self.predict(edge))
        low = point - widen * max(point - float(q_lo), 0.0) - (widen - 1.0) * gain
        high = point + widen * max(float(q_hi) - point, 0.0) + (widen - 1.0) * gain
        return low, point, high


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def fit_scaling(
    x: ArrayLike,
    loss: ArrayLike,
    *,
    alpha_range: tuple[float, float] = (0.01, 2.0),
    n_bootstrap: int = 400,
    seed: int = 0,
) -> ScalingFit:
    """Least-squares fit of L(x) = a + b·x^(−α) (seeds 001 §10, extrapolation).

    For fixed α the model is linear in (a, b), so they are solved in closed form and
    α minimises the profiled residual sum of squares: a grid over ``alpha_range``,
    then seven 10× zoom levels around the best point. x is rescaled by its geometric
    mean while fitting, for conditioning. Uncertainty comes from a residual
    bootstrap with a fixed ``seed``: residuals inflated by sqrt(n/(n−3)) are
    resampled onto the fitted curve and refitted ``n_bootstrap`` times. Needs at
    least 4 points at 3 or more distinct x values.
    """
    xs = np.asarray(x, dtype=np.float64).ravel()
    ys = np.asarray(loss, dtype=np.float64).ravel()
    if xs.shape != ys.shape:
        raise ValueError(f"x has {xs.size} values but loss has {ys.size}")
    if xs.size < 4 or np.unique(xs).size < 3:
        raise ValueError("need at least 4 points at 3 or more distinct x values")
    if not (np.isfinite(xs).all() and (xs > 0).all() and np.isfinite(ys).all()):
        raise ValueError("x must be finite and > 0, loss finite")
    lo, hi = alpha_range
    if not 0.0 < lo < hi:
        raise ValueError(f"alpha_range must satisfy 0 < low < high, got {alpha_range!r}")
    if not _is_int(n_bootstrap) or n_bootstrap < 10:
        raise ValueError(f"n_bootstrap must be an int >= 10, got {n_bootstrap!r}")
    log_x = np.log(xs)
    log_ref = float(log_x.mean())
    log_u = log_x - log_ref
    a, b_u, alpha = (float(v[0]) for v in _fit_columns(log_u, ys[:, None], lo, hi))
    fitted = a + b_u * np.exp(-alpha * log_u)
    resid = (ys - fitted) * math.sqrt(xs.size / (xs.size - 3))
    rng = np.random.default_rng(seed)
    y_star = fitted[:, None] + resid[rng.integers(0, xs.size, size=(xs.size, n_bootstrap))]
    boot_a, boot_bu, boot_alpha = _fit_columns(log_u, y_star, lo, hi)
    return ScalingFit(
        a=a,
        b=b_u * math.exp(alpha * log_ref),
        alpha=alpha,
        x_min=float(xs.min()),
        x_max=float(xs.max()),
        rss=float(((ys - fitted) ** 2).sum()),
        n_points=int(xs.size),
        boot_a=boot_a,
        boot_b=boot_bu * np.exp(boot_alpha * log_ref),
        boot_alpha=boot_alpha,
    )
