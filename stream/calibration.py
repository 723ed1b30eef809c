"""Detector thresholds from a stable run's recorded series (seeds 001 §4, "Thresholds").

Calibrate on healthy runs, never on one failure: each z threshold is the margin times a
high quantile of the robust z-scores the detector itself produced on the stable series.
The held-level rules (MaxVio, the shard imbalance: a value above a threshold on k
consecutive steps) get the margin times a high quantile of the level the stable run held
for k steps in a row (the rolling minimum over k consecutive measured steps, after the
detector window's warm-up). The three straggler tiers get the margin times a high
quantile of the level their own rule (``stragglers``) computes on the stored own-time
ratio, its baseline included (``straggler_levels``). The drift rules (a clip-rate rise, an
H_norm drop: a move over the signal's own baseline) get the margin times a high quantile
of the move the stable run held, and the grad-norm audit the margin times a high quantile
of the loop's norm's relative mismatch to G2. The residual branches' bounds come from
``residual_stats`` (``residual_bounds``), the held-out BPB rise from the reference stream's
``bpb`` evaluations (``heldout_rises``). A series the run does not have (no experts, no
step with three ranks for the held and recent straggler tiers, no residual rows or
evaluations, a loop that clips through the monitor) gives no threshold; a level of 0 or below (a constant clip rate, a BPB that only fell)
gives none either (the default stays). The CUSUMs' h are not calibrated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .detect import RankLevels, calibrate
from .findings import DetectorConfig
from .rolling import sorted_median
from .series import Series
from .series import StepMetrics as SM

__all__ = [
    "COLUMNS",
    "DETECTOR_FIELDS",
    "MIN_WINDOWS",
    "Calibration",
    "audit_level",
    "calibrate_run",
    "drift_level",
    "heldout_rises",
    "held_level",
    "quantile_level",
    "residual_bounds",
    "straggler_levels",
]

MIN_WINDOWS = 3
"""A stable run shorter than this many detector windows calibrates nothing: the first
window only warms the detector up, so fewer would put a threshold on a handful of scores."""

# stream setting -> step_metrics column it is calibrated on
CALIBRATED = {
    "loss_z_threshold": SM.loss,
    "grad_z_threshold": SM.grad_norm,
    "signal_z_threshold": SM.step_time_s,
}
# held-level setting -> (step_metrics column, the stream setting naming k)
HELD = {
    "maxvio_threshold": (SM.moe_maxvio, "maxvio_steps"),
    "shard_imbalance_max": (SM.moe_shard_imbalance, "maxvio_steps"),
}
# straggler tier (``stragglers.StragglerRules._held``) -> (the setting naming its k, the
# setting naming its level quantile (None: the minimum), the fewest ranks it scores with)
STRAGGLER: dict[str, tuple[str, str | None, int]] = {
    "straggler_ratio": ("straggler_steps", None, 0),
    "straggler_held_ratio": ("straggler_held_steps", "straggler_held_quantile", 3),
    "straggler_recent_ratio": ("straggler_recent_steps", "straggler_recent_quantile", 3),
}
# drift setting -> (step_metrics column, direction: +1 a rise is bad, -1 a drop, the k
# setting): margin x quantile of the move the stable run held for k steps over its own
# baseline (the median of the window before), the rules of ``directions``
DRIFT: dict[str, tuple[Series, int, str | None]] = {
    "clip_rate_rise": (SM.clip_rate, 1, None),
    "h_norm_drop": (SM.moe_h_norm, -1, "maxvio_steps"),
}
# the grad-norm audit: margin x quantile of |grad_clip_norm - G2| / G2 on the stable run
AUDIT = ("grad_audit_tolerance", SM.grad_clip_norm, SM.grad_norm)
COLUMNS = tuple(
    sorted(
        {
            *CALIBRATED.values(),
            *(c for c, _ in HELD.values()),
            SM.straggler_own_ratio,
            SM.ranks_reporting,
            *(c for c, _, _ in DRIFT.values()),
            *AUDIT[1:],
        }
    )
)
RESIDUAL = "residual_stats.ratio"  # the series the residual bounds are calibrated on
HELDOUT = "evaluations.bpb"  # the heldout_bpb_rise's (reference weights stream)
# calibrated setting -> its field of stream.stage2.detectors (DetectorConfig)
DETECTOR_FIELDS = {
    "loss_z_threshold": "loss_z",
    "grad_z_threshold": "grad_z",
    "signal_z_threshold": "signal_z",
    "maxvio_threshold": "maxvio_threshold",
    "straggler_ratio": "straggler_ratio",
    "straggler_held_ratio": "straggler_held_ratio",
    "straggler_recent_ratio": "straggler_recent_ratio",
    "shard_imbalance_max": "shard_imbalance_max",
    "clip_rate_rise": "clip_rate_rise",
    "h_norm_drop": "h_norm_drop",
    "grad_audit_tolerance": "grad_audit_tolerance",
    "residual_ratio_max": "residual_ratio_max",
    "residual_ratio_min": "residual_ratio_min",
    "heldout_bpb_rise": "heldout_bpb_rise",
}


@dataclass(frozen=True, slots=True)
class Calibration:
    setting: str
    column: str
    threshold: float
    n_steps: int


def quantile_level(levels: Iterable[float | None], quantile: float, margin: float) -> float | None:
    """margin x the ``quantile``-quantile of the levels that are not None; None when none
    is."""
    held = [v for v in levels if v is not None]
    if not held:
        return None
    return margin * float(np.quantile(np.asarray(held, dtype=np.float64), quantile))


def held_level(
    values: Sequence[float | None], steps: int, skip: int, quantile: float, margin: float
) -> float | None:
    """margin x quantile of the rolling minimum over ``steps`` consecutive measured values
    (a missing value breaks the run), ignoring the first ``skip`` values; None when no
    run of ``steps`` values exists."""
    held: list[float] = []
    run: list[float] = []
    for v in list(values)[skip:]:
        run = [] if v is None or not math.isfinite(v) else (run + [v])[-steps:]
        if len(run) == steps:
            held.append(min(run))
    return quantile_level(held, quantile, margin)


def straggler_levels(
    ratios: Sequence[float | None], window: int, recent: int, steps: int, level_quantile: float
) -> list[float | None]:
    """The level a straggler tier of ``stragglers`` compares with its threshold, at each
    step of the stored own-time ratio: ``detect.RankLevels`` (the rule's own class, its
    ``window`` and ``recent`` = the largest of the tiers' k) fed the column as one rank,
    ``held(rank, steps, level_quantile)`` = exp(level quantile of log rho over the last
    ``steps`` consecutive steps) over the baseline max(1, exp(median of the ``window``
    values before the last ``recent``)); None where the rule has no level (warm-up, a
    missing value in the last ``steps``). Values are taken as consecutive steps.

    Exact: the rolling quantile, the baseline, its parity floor and its warm-up are the
    rule's, computed by its code. An approximation: the stored column is one series per
    step, the ratio of the rank with the largest own time, which is the largest rho_r of
    the step (its leave-one-out median is the smallest); the rule scores each rank's own
    series against that rank's own baseline. A rank's level quantile is at most the
    column's over the same steps, and so is its baseline, so the column's level is neither
    an upper nor a lower bound on a rank's: a rank that is the slowest on most steps is
    scored as the rule scores it; healthy ranks that take turns being the slowest lift the
    column's quantile and its baseline together."""
    levels = RankLevels(window=window, recent=recent)
    out: list[float | None] = []
    for step, rho in enumerate(ratios):
        levels.update(step, {} if rho is None else {0: rho})
        out.append(levels.held(0, steps, level_quantile))
    return out


def residual_bounds(
    rows: Iterable[tuple[int, float | None]], quantile: float, margin: float
) -> tuple[float, float, int] | None:
    """From ``residual_stats`` rows (step, R_b) of every layer and branch: (margin x
    quantile of the per-step largest R_b, the (1 - quantile)-quantile of the per-step
    smallest R_b / margin, the steps measured): the bounds ``residual_ratio_max`` (the
    largest branch above it pages, ``directions``) and ``residual_ratio_min`` (the weakest
    below it, ``signals``) compare each step's extremes with. Non-finite R_b are not
    measurements (the stream stores only finite ones); None when no step has one."""
    by_step: dict[int, list[float]] = {}
    for step, ratio in rows:
        if ratio is not None and math.isfinite(ratio):
            by_step.setdefault(int(step), []).append(float(ratio))
    if not by_step:
        return None
    high = np.array([max(v) for v in by_step.values()], dtype=np.float64)
    low = np.array([min(v) for v in by_step.values()], dtype=np.float64)
    return (
        margin * float(np.quantile(high, quantile)),
        float(np.quantile(low, 1.0 - quantile)) / margin,
        len(by_step),
    )


def heldout_rises(
    rows: Iterable[tuple[str, int, float | None]], window: int, min_history: int
) -> list[float]:
    """The relative rise value / baseline - 1 of each evaluation ``heldout.HeldoutRise``
    scores (``heldout_bpb_rise`` pages at or above it), from (suite, step, bpb) rows of the
    reference weights stream in arrival (step) order: per suite, the baseline is the
    median of its last ``window`` finite values before this one, from ``min_history`` of
    them on; a step at or before the suite's last is a re-delivery (skipped), a non-finite
    value pages on its own (not a rise here)."""
    suites: dict[str, tuple[int, list[float]]] = {}
    rises: list[float] = []
    for suite, step, value in rows:
        last, values = suites.get(suite, (-1, []))
        if step <= last:
            continue
        if value is not None and math.isfinite(value):
            if len(values) >= min_history and (base := sorted_median(sorted(values))) > 0:
                rises.append(value / base - 1.0)
            values = [*values, value][-window:]
        suites[suite] = (step, values)
    return rises


def drift_level(
    values: Sequence[float | None],
    window: int,
    steps: int,
    direction: int,
    quantile: float,
    margin: float,
) -> float | None:
    """margin x quantile of the move a stable run held on ``steps`` consecutive measured
    values over its baseline: d_t = direction (v_t - median of the up to ``window``
    measured values before it), from the ``window``-th measured value on; held = the
    rolling minimum of d over ``steps`` consecutive ones (a missing value breaks the run).
    None when no run exists."""
    seen: list[float] = []
    moves: list[float | None] = []
    for v in values:
        if v is None or not math.isfinite(v):
            moves.append(None)
            continue
        if len(seen) >= window:
            moves.append(direction * (v - float(np.median(seen[-window:]))))
        else:
            moves.append(None)
        seen.append(v)
    return held_level(moves, steps, 0, quantile, margin)


def audit_level(
    reported: Sequence[float | None],
    measured: Sequence[float | None],
    quantile: float,
    margin: float,
) -> float | None:
    """margin x quantile of |reported - measured| / measured over the steps with both
    (finite, measured > 0); None when the run has none (its loop clipped through the
    monitor, or did not report a norm)."""
    pairs = [
        (r, m)
        for r, m in zip(reported, measured)
        if r is not None and m is not None and math.isfinite(r) and math.isfinite(m) and m > 0
    ]
    if not pairs:
        return None
    rel = np.array([abs(r - m) / m for r, m in pairs], dtype=np.float64)
    return margin * float(np.quantile(rel, quantile))


def calibrate_run(
    series: Mapping[str, Sequence[float | None]],
    window: int,
    quantile: float = 0.999,
    margin: float = 1.5,
    detectors: DetectorConfig | None = None,
    residual: Iterable[tuple[int, float | None]] = (),
    evaluations: Iterable[tuple[str, int, float | None]] = (),
) -> list[Calibration]:
    """One threshold per calibrated setting; missing values (None) are dropped first.
    ``detectors`` gives the rules' k and level quantiles (``maxvio_steps``,
    ``straggler_held_quantile``, ...; default ``DetectorConfig()``); ``residual`` are the
    run's ``residual_stats`` (step, R_b) rows, ``evaluations`` its reference-stream
    (suite, step, bpb) rows in step order. A series that is absent gives no row. A
    ValueError for a run shorter than ``MIN_WINDOWS`` windows."""
    steps = max((len(v) for v in series.values()), default=0)
    if steps < MIN_WINDOWS * window:
        raise ValueError(
            f"the run has {steps} steps: a series needs more than window={window} values, "
            f"and calibration at least {MIN_WINDOWS} detector windows of stable steps "
            f"({MIN_WINDOWS} x {window} = {MIN_WINDOWS * window}); calibrate on a longer "
            "stable run, or pass a smaller --window"
        )
    cfg = detectors or DetectorConfig()
    out = []
    for setting, column in CALIBRATED.items():
        values = [v for v in series.get(column, []) if v is not None and math.isfinite(v)]
        out.append(
            Calibration(setting, column, calibrate(values, window, quantile, margin), len(values))
        )
    for setting, (column, k_setting) in HELD.items():
        held_values = list(series.get(column, []))
        level = held_level(held_values, getattr(cfg, k_setting), window, quantile, margin)
        if level is not None:
            n = sum(v is not None for v in held_values[window:])
            out.append(Calibration(setting, column, level, n))
    out += _stragglers(series, window, quantile, margin, cfg)
    for drift, (column, direction, k_of) in DRIFT.items():
        moved = list(series.get(column, []))
        k = getattr(cfg, k_of) if k_of else 1
        level = drift_level(moved, window, k, direction, quantile, margin)
        if level is not None and level > 0:
            out.append(Calibration(drift, column, level, sum(v is not None for v in moved)))
    audit, reported, measured = AUDIT
    level = audit_level(series.get(reported, []), series.get(measured, []), quantile, margin)
    if level is not None and level > 0:
        n = sum(v is not None for v in series.get(reported, []))
        out.append(Calibration(audit, reported, level, n))
    return out + _tables(residual, evaluations, quantile, margin, cfg)


def _stragglers(
    series: Mapping[str, Sequence[float | None]],
    window: int,
    quantile: float,
    margin: float,
    cfg: DetectorConfig,
) -> list[Calibration]:
    """The straggler tiers, each on the steps its rule scores (``ranks_reporting`` at
    least its fewest ranks)."""
    ratios = list(series.get(SM.straggler_own_ratio, []))
    ranks = list(series.get(SM.ranks_reporting, []))
    recent = max(getattr(cfg, k) for k, _, _ in STRAGGLER.values())
    out = []
    for setting, (k_setting, q_setting, min_ranks) in STRAGGLER.items():
        q = getattr(cfg, q_setting) if q_setting else 0.0
        levels = straggler_levels(ratios, window, recent, getattr(cfg, k_setting), q)
        scored = [
            v
            for t, v in enumerate(levels)
            if min_ranks == 0 or (t < len(ranks) and (ranks[t] or 0) >= min_ranks)
        ]
        level = quantile_level(scored, quantile, margin)
        if level is not None:
            n = sum(v is not None for v in scored)
            out.append(Calibration(setting, SM.straggler_own_ratio, level, n))
    return out


def _tables(
    residual: Iterable[tuple[int, float | None]],
    evaluations: Iterable[tuple[str, int, float | None]],
    quantile: float,
    margin: float,
    cfg: DetectorConfig,
) -> list[Calibration]:
    """The thresholds calibrated on ``residual_stats`` and ``evaluations`` rows."""
    out = []
    bounds = residual_bounds(residual, quantile, margin)
    if bounds is not None:
        high, low, n = bounds
        out.append(Calibration("residual_ratio_max", RESIDUAL, high, n))
        if low > 0:
            out.append(Calibration("residual_ratio_min", RESIDUAL, low, n))
    rises = heldout_rises(evaluations, cfg.heldout_window, cfg.heldout_min_history)
    level = quantile_level(rises, quantile, margin)
    if level is not None and level > 0:
        out.append(Calibration("heldout_bpb_rise", HELDOUT, level, len(rises)))
    return out
