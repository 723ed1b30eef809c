"""Reference tests for probewire.evaluators.scores (seeds 001 §10)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from probewire.evaluators.scores import (
    ChoiceResult,
    bits_per_byte,
    choice_accuracy,
    choice_suite_version,
    exact_match,
    fit_scaling,
    iou,
    media_gain,
    nll_and_ppl,
    pass_at_k,
    utf8_byte_count,
)

# --- NLL / PPL -----------------------------------------------------------------


def test_nll_and_ppl_match_numpy_with_mask() -> None:
    rng = np.random.default_rng(0)
    nlls = rng.gamma(2.0, 1.5, size=(4, 37))
    mask = rng.random((4, 37)) < 0.6
    nll, ppl = nll_and_ppl(nlls, mask)
    ref = float(np.mean(nlls[mask], dtype=np.float64))
    assert nll == pytest.approx(ref, rel=1e-12)
    assert ppl == pytest.approx(np.exp(ref), rel=1e-12)


def test_nll_ignores_padding_values_under_zero_mask() -> None:
    nll, ppl = nll_and_ppl([1.0, 3.0, 1e9], [1, 1, 0])
    assert nll == 2.0
    assert ppl == pytest.approx(math.exp(2.0))


def test_nll_without_mask_uses_every_token() -> None:
    assert nll_and_ppl([0.5, 1.5]) == (1.0, pytest.approx(math.e))


@pytest.mark.parametrize("nlls, mask", [([], None), ([1.0, 2.0], [False, False])])
def test_nll_with_no_valid_token_raises(nlls: list[float], mask: list[bool] | None) -> None:
    with pytest.raises(ValueError, match="no valid tokens"):
        nll_and_ppl(nlls, mask)


def test_nll_rejects_mask_of_wrong_shape_or_values() -> None:
    with pytest.raises(ValueError, match="shape"):
        nll_and_ppl([1.0, 2.0], [1])
    with pytest.raises(ValueError, match="0/1"):
        nll_and_ppl([1.0, 2.0], [1, 2])


def test_ppl_overflow_is_inf() -> None:
    assert nll_and_ppl([1000.0])[1] == math.inf


# --- bits per byte -------------------------------------------------------------


@pytest.mark.parametrize(
    "text, hand_count",
    [
        ("abc", 3),
        ("é", 2),
        ("中", 3),
        ("😀", 4),
        ("café 中文 😀!", 3 + 2 + 1 + 3 + 3 + 1 + 4 + 1),
    ],
)
def test_utf8_byte_count_matches_hand_count_and_encode(text: str, hand_count: int) -> None:
    assert utf8_byte_count(text) == hand_count == len(text.encode())


def test_bits_per_byte_on_multibyte_text() -> None:
    text = "é中😀"  # 2 + 3 + 4 = 9 bytes
    total_nll = 9 * math.log(2)  # exactly one bit per byte
    assert bits_per_byte(total_nll, utf8_byte_count(text)) == pytest.approx(1.0, rel=1e-15)
    assert bits_per_byte(3.0, 9) == pytest.approx(3.0 / (9 * math.log(2)), rel=1e-15)


@pytest.mark.parametrize("total, n_bytes", [(1.0, 0), (1.0, -3), (1.0, 2.5), (-1.0, 4)])
def test_bits_per_byte_rejects_bad_input(total: float, n_bytes: int) -> None:
    with pytest.raises(ValueError):
        bits_per_byte(total, n_bytes)


# --- choice accuracy -----------------------------------------------------------


def test_length_normalisation_changes_the_choice() -> None:
    # option 0: 6 tokens at 1.0 nat each (sum 6); option 1: 2 tokens at 2.0 (sum 4)
    nlls, tokens, nbytes = [[6.0, 4.0]], [[6, 2]], [[30, 5]]
    raw = choice_accuracy(nlls, None, [0], "none")
    per_token = choice_accuracy(nlls, tokens, [0], "tokens")
    per_byte = choice_accuracy(nlls, nbytes, [0], "bytes")  # 0.2 vs 0.8 nat/byte
    assert raw.predicted == (1,) and raw.accuracy == 0.0
    assert per_token.predicted == (0,) and per_token.accuracy == 1.0
    assert per_byte.predicted == (0,) and per_byte.normalization == "bytes"


def test_choice_ties_go_to_lowest_index() -> None:
    result = choice_accuracy([[3.0, 1.0, 1.0], [3.0, 3.0]], [[1, 1, 1], [1, 1]], [2, 1], "tokens")
    expected = ChoiceResult(accuracy=0.0, n_correct=0, predicted=(1, 0), normalization="tokens")
    assert result == expected


@pytest.mark.parametrize("normalization", ["none", "tokens", "bytes"])
def test_choice_accuracy_matches_numpy_argmin(normalization: str) -> None:
    rng = np.random.default_rng(7)
    nlls = rng.gamma(3.0, 2.0, size=(200, 4))
    lengths = rng.integers(1, 40, size=(200, 4))
    answers = rng.integers(0, 4, size=200)
    scores = nlls if normalization == "none" else nlls / lengths
    ref = np.argmin(scores, axis=1)
    result = choice_accuracy(nlls.tolist(), lengths.tolist(), answers.tolist(), normalization)
    assert result.predicted == tuple(ref.tolist())
    assert result.accuracy == float(np.mean(ref == answers))
    assert result.n_correct == int(np.sum(ref == answers))


def test_choice_accepts_ragged_option_lists() -> None:
    result = choice_accuracy([[1.0, 0.5], [0.1, 0.2, 0.05]], [[1, 1], [1, 1, 1]], [1, 0], "tokens")
    assert result.predicted == (1, 2) and result.accuracy == 0.5


@pytest.mark.parametrize(
    "args, message",
    [
        (([], [], [], "tokens"), "no questions"),
        (([[1.0, 2.0]], None, [0], "tokens"), "needs option_lengths"),
        (([[1.0, 2.0]], [[1, 0]], [0], "tokens"), "> 0"),
        (([[1.0, 2.0]], [[1, 1]], [2], "tokens"), "not an option index"),
        (([[1.0, 2.0]], [[1, 1]], [True], "tokens"), "not an option index"),
        (([[1.0, 2.0]], [[1]], [0], "tokens"), "lengths"),
        (([[1.0, float("nan")]], [[1, 1]], [0], "tokens"), "NaN"),
        (([[1.0, 2.0]], [[1, 1]], [0], "chars"), "normalization"),
    ],
)
def test_choice_accuracy_rejects_bad_input(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choice_accuracy(*args)


def test_suite_version_names_the_normalisation() -> None:
    assert choice_suite_version("mc-stdlib-v1", "bytes") == "mc-stdlib-v1+norm=bytes"
    assert choice_suite_version("v1", "tokens") != choice_suite_version("v1", "none")


# --- exact match, media gain ----------------------------------------------------


def test_exact_match_with_and_without_normalizer() -> None:
    assert exact_match("42", "42") is True
    assert exact_match(" 42\n", "42") is False
    assert exact_match(" 42\n", "42", str.strip) is True
    assert exact_match("Paris", "paris", lambda s: s.lower()) is True


def test_media_gain_is_difference() -> None:
    assert media_gain(0.75, 0.5) == 0.25
    assert media_gain(0.5, 0.5) == 0.0
    with pytest.raises(ValueError):
        media_gain(float("nan"), 0.1)


# --- pass@k ----------------------------------------------------------------------


def _pass_at_k_comb(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize(
    "n, c, k",
    [(10, 0, 1), (10, 10, 1), (10, 10, 10), (10, 3, 1), (10, 3, 5), (10, 3, 7),
     (10, 3, 8), (20, 1, 20), (50, 7, 10), (200, 13, 100), (1, 0, 1), (1, 1, 1)],
)  # fmt: skip
def test_pass_at_k_matches_binomial_formula(n: int, c: int, k: int) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_comb(n, c, k), rel=1e-12, abs=1e-15)


def test_pass_at_k_edge_values() -> None:
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 10, 3) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # n - c = 2 < k
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(5, 1, 6), (5, 1, 0), (5, 6, 1), (5, -1, 1), (0, 0, 0)])
def test_pass_at_k_rejects_out_of_range(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_pass_at_k_rejects_non_integers() -> None:
    with pytest.raises(TypeError):
        pass_at_k(10, 2.0, 1)  # type: ignore[arg-type]


# --- IoU -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, expected",
    [
        ((0, 0, 1, 1), (2, 2, 3, 3), 0.0),  # disjoint
        ((0, 0, 1, 1), (1, 0, 2, 1), 0.0),  # touching edge
        ((0, 0, 4, 4), (1, 1, 3, 3), 0.25),  # nested: 4 / 16
        ((0, 0, 2, 3), (0, 0, 2, 3), 1.0),  # identical
        ((0, 0, 2, 1), (1, 0, 3, 1), 1.0 / 3.0),  # half overlap: 1 / 3
        ((0, 0, 2, 2), (1, 1, 3, 3), 1.0 / 7.0),  # corner overlap: 1 / (4 + 4 - 1)
        ((1, 1, 1, 1), (1, 1, 1, 1), 1.0),  # identical points: zero union, defined 1
        ((1, 1, 1, 1), (2, 2, 2, 2), 0.0),  # different points: zero union, defined 0
        ((0, 0, 2, 2), (1, 1, 1, 1), 0.0),  # point inside a box
    ],
)
def test_iou_known_overlaps(a: tuple, b: tuple, expected: float) -> None:
    assert iou(a, b) == pytest.approx(expected, rel=1e-15)
    assert iou(b, a) == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize("box", [(1, 0, 0, 1), (0, 1, 1, 0), (0, 0, 1), (0, 0, float("inf"), 1)])
def test_iou_rejects_invalid_boxes(box: tuple) -> None:
    with pytest.raises(ValueError):
        iou(box, (0, 0, 1, 1))


# --- scaling fit -----------------------------------------------------------------

A_TRUE, B_TRUE, ALPHA_TRUE = 1.7, 4.0e6, 0.35


def _law(x: np.ndarray | float) -> np.ndarray | float:
    return A_TRUE + B_TRUE * np.power(x, -ALPHA_TRUE)


def test_scaling_fit_recovers_noiseless_parameters() -> None:
    x = np.logspace(18, 20, 12)  # FLOPs
    fit = fit_scaling(x, _law(x))
    assert fit.a == pytest.approx(A_TRUE, rel=1e-6)
    assert fit.b == pytest.approx(B_TRUE, rel=1e-5)
    assert fit.alpha == pytest.approx(ALPHA_TRUE, rel=1e-6)
    assert (fit.x_min, fit.x_max, fit.n_points) == (1e18, 1e20, 12)
    assert fit.predict(1e21) == pytest.approx(_law(1e21), rel=1e-7)


def test_noiseless_extrapolation_still_returns_a_bound() -> None:
    x = np.logspace(18, 20, 12)
    low, point, high = fit_scaling(x, _law(x)).predict_bound(1e21)
    assert low < point < high
    assert point == pytest.approx(_law(1e21), rel=1e-7)


def test_bound_contains_truth_at_10x_and_is_wider_outside() -> None:
    x = np.logspace(18, 20, 12)
    rng = np.random.default_rng(3)
    loss = _law(x) * (1.0 + 0.01 * rng.standard_normal(x.size))
    fit = fit_scaling(x, loss, seed=0)
    x_far = 10.0 * fit.x_max
    low, point, high = fit.predict_bound(x_far, confidence=0.9)
    assert low <= _law(x_far) <= high
    assert low <= point <= high
    in_low, _, in_high = fit.predict_bound(1e19, confidence=0.9)
    assert high - low > in_high - in_low > 0.0


def test_scaling_fit_is_deterministic_for_a_seed() -> None:
    x = np.logspace(9, 11, 8)  # tokens
    loss = _law(x) + np.linspace(-0.01, 0.01, 8)
    first = fit_scaling(x, loss, seed=5).predict_bound(1e12)
    assert fit_scaling(x, loss, seed=5).predict_bound(1e12) == first


@pytest.mark.parametrize(
    "x, loss",
    [
        ([1.0, 2.0, 3.0], [3.0, 2.0, 1.5]),  # fewer than 4 points
        ([1.0, 1.0, 2.0, 2.0], [1.0] * 4),  # only 2 distinct x
        ([0.0, 1.0, 2.0, 3.0], [1.0] * 4),  # x = 0
    ],
)
def test_scaling_fit_rejects_unusable_data(x: list[float], loss: list[float]) -> None:
    with pytest.raises(ValueError):
        fit_scaling(x, loss)
