"""Suites against NumPy float64 references on models whose outputs are known exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probewire.evaluators import (
    ByteTokenizer,
    ChoiceSuite,
    EvalModel,
    EvaluationError,
    GenerationSuite,
    GroundingSuite,
    HeldoutSuite,
    Judge,
    MediaGain,
    PassAtKSuite,
    SeededSampler,
    ThresholdBoxPredictor,
    make_grounding_set,
)
from probewire.evaluators.datasets import ChoiceItem, GenerationItem, GroundingItem, HeldoutDoc
from probewire.evaluators.testing import BigramLM, CharTokenizer, QuantileSampler

V_BYTES = 257  # 256 bytes + BOS, as ByteTokenizer


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _random_table(v: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, size=(v, v))


# --- held-out NLL / perplexity / bits per byte ---------------------------------------


@pytest.mark.parametrize("context_len", [3, 5, 64])
def test_bpb_counts_utf8_bytes_not_tokens(context_len: int) -> None:
    """A character tokenizer on multi-byte text: M tokens ≠ N_byte bytes. Every token is
    scored once; each full block of ``context_len`` targets starts at BOS, and a final
    shorter block sees the tokens before it as context."""
    texts = ["café ☕ naïve", "中文 and 😀 emoji", "plain ascii"]
    alphabet = "".join(sorted({c for t in texts for c in t}))
    tok = CharTokenizer(alphabet)
    table = _random_table(len(alphabet) + 1, seed=1)
    model = EvalModel(module=BigramLM(table), tokenizer=tok, context_len=context_len, batch_size=2)
    scores = {
        s.metric: s
        for s in HeldoutSuite([HeldoutDoc(text=t, source="unit") for t in texts]).run(model)
    }

    logp = _log_softmax(table)
    total, m = 0.0, 0
    for text in texts:
        ids = tok.encode(text)
        for j, token in enumerate(ids):
            block_starts_at_bos = j % context_len == 0 and (j == 0 or j + context_len <= len(ids))
            prev = tok.bos_id if block_starts_at_bos else ids[j - 1]
            total -= logp[prev, token]
            m += 1
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert n_bytes > m  # the text really is multi-byte
    assert scores["nll"].value == pytest.approx(total / m, rel=1e-12)
    assert scores["ppl"].value == pytest.approx(math.exp(total / m), rel=1e-12)
    assert scores["bpb"].value == pytest.approx(total / (n_bytes * math.log(2)), rel=1e-12)
    assert {s.n_items for s in scores.values()} == {3}
    assert not any(s.higher_is_better for s in scores.values())


def test_bpb_of_byte_model_on_multibyte_text() -> None:
    """With byte tokens, a uniform model has BPB exactly log2(257) whatever the script."""
    model = EvalModel(
        module=BigramLM(np.zeros((V_BYTES, V_BYTES))), tokenizer=ByteTokenizer(), context_len=8
    )
    docs = [HeldoutDoc(text="Grüße, 世界! 🎉", source="unit")]
    bpb = {s.metric: s.value for s in HeldoutSuite(docs).run(model)}["bpb"]
    assert bpb == pytest.approx(math.log2(257), rel=1e-12)


def test_model_with_wrong_output_shape_is_a_clear_error() -> None:
    class Flat(torch.nn.Module):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return torch.zeros(tokens.shape[0], 257)

    model = EvalModel(module=Flat(), tokenizer=ByteTokenizer(), context_len=8)
    with pytest.raises(EvaluationError, match=r"expected logits \[B, T, V\]"):
        HeldoutSuite([HeldoutDoc(text="abc", source="u")]).run(model)


def test_empty_dataset_is_rejected_with_one_line() -> None:
    with pytest.raises(EvaluationError) as info:
        HeldoutSuite([])
    assert str(info.value) == "suite heldout: empty dataset, nothing to score"


# --- multiple choice ------------------------------------------------------------------


def _unigram_model(probs: dict[str, float]) -> EvalModel:
    """Every position predicts the same distribution: NLL of a string = Σ −log p(char)."""
    row = np.full(V_BYTES, -1e9)
    for char, p in probs.items():
        row[ord(char)] = math.log(p)
    return EvalModel(
        module=BigramLM(np.tile(row, (V_BYTES, 1))), tokenizer=ByteTokenizer(), context_len=64
    )


@pytest.mark.parametrize(
    ("normalization", "expected_accuracy"), [("none", 0.0), ("tokens", 1.0), ("bytes", 1.0)]
)
def test_length_normalisation_changes_the_chosen_option(
    normalization: str, expected_accuracy: float
) -> None:
    """ "z" costs less in total, "aaaaaaaa" less per byte: the normalisation decides."""
    probs = {" ": 0.25, "a": 0.5, "z": 0.125, "q": 0.125}
    model = _unigram_model(probs)
    item = ChoiceItem(question="qq", options=("z", "aaaaaaaa"), answer=1)
    suite = ChoiceSuite([item], normalization=normalization)

    def nll(text: str) -> float:
        return -sum(math.log(probs[c]) for c in text)

    totals = [nll(" z"), nll(" aaaaaaaa")]
    per_byte = [totals[0] / 2, totals[1] / 9]
    assert np.argmin(totals) == 0 and np.argmin(per_byte) == 1  # the construction holds
    [score] = suite.run(model)
    assert (score.metric, score.value, score.n_items) == ("accuracy", expected_accuracy, 1)
    assert suite.versions(model).suite == f"choice/v1+norm={normalization}"


# --- greedy generation ------------------------------------------------------------------


def _successor_model(successor: dict[str, str]) -> EvalModel:
    """argmax of the next byte after c is successor[c] (logit 5 vs 0), else newline."""
    table = np.zeros((V_BYTES, V_BYTES))
    table[:, ord("\n")] = 1.0
    for c, nxt in successor.items():
        table[ord(c), ord(nxt)] = 5.0
    return EvalModel(module=BigramLM(table), tokenizer=ByteTokenizer(), context_len=4, batch_size=2)


def test_greedy_decode_follows_the_known_argmax() -> None:
    model = _successor_model({"=": "4", "4": "2", ":": " ", " ": "o", "o": "k"})
    items = [
        GenerationItem(prompt="2+2=", answer="42"),
        GenerationItem(prompt="a long prompt past the context: ", answer="ok"),
        GenerationItem(prompt="3+3=", answer="6"),
    ]
    suite = GenerationSuite(items, max_new_tokens=5)
    [score] = suite.run(model)
    # "=" -> "4" -> "2" -> "\n" (stop); " " -> "o" -> "k" -> "\n"; post-processing strips
    assert suite.last_answers == ["42", "ok", "42"]
    assert (score.metric, score.value, score.n_items) == ("exact_match", 2 / 3, 3)
    versions = suite.versions(model)
    assert versions.decoding.startswith("greedy;T=0;max_new_tokens=5")
    assert (versions.postprocess, versions.judge) == ("first-line-strip/v1", "exact_match/v1")


def test_a_checker_function_replaces_exact_match() -> None:
    model = _successor_model({"=": "4"})
    numeric = Judge(
        "numeric_close",
        "numeric-close/v1",
        lambda answer, item: abs(float(answer) - float(item.answer)) <= 1,
    )
    [score] = GenerationSuite(
        [GenerationItem(prompt="1+4=", answer="5")], judge=numeric, max_new_tokens=3
    ).run(model)
    assert (score.metric, score.value) == ("numeric_close", 1.0)


# --- pass@k -----------------------------------------------------------------------------


def _two_answer_model(p_four: float) -> EvalModel:
    """After "=": "4" with probability p_four, "5" otherwise; after either: newline."""
    table = np.full((V_BYTES, V_BYTES), -np.inf)
    table[:, ord("\n")] = 0.0
    table[ord("=")] = -np.inf
    table[ord("="), ord("4")] = math.log(p_four)
    table[ord("="), ord("5")] = math.log(1 - p_four)
    return EvalModel(
        module=BigramLM(table), tokenizer=ByteTokenizer(), context_len=16, batch_size=7
    )


def test_pass_at_k_matches_the_combinatorial_formula() -> None:
    n = 10
    items = [GenerationItem(prompt="2+2=", answer="4"), GenerationItem(prompt="2+3=", answer="5")]
    suite = PassAtKSuite(
        items, n=n, ks=(1, 4), temperature=1.0, max_new_tokens=3, sampler=QuantileSampler(n)
    )
    scores = {s.metric: s.value for s in suite.run(_two_answer_model(0.3))}
    # quantiles 0.05..0.95: three fall below P("4") = 0.3
    assert suite.last_passes == [3, 7]

    def reference(c: int, k: int) -> float:
        return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # comb(3, 4) = 0: n − c < k

    assert scores["pass@1"] == pytest.approx((reference(3, 1) + reference(7, 1)) / 2, abs=1e-12)
    assert scores["pass@4"] == pytest.approx((reference(3, 4) + 1.0) / 2, abs=1e-12)
    assert scores["pass@4"] == pytest.approx((1 - 35 / 210 + 1) / 2, abs=1e-12)


def test_seeded_sampling_is_reproducible_across_runs() -> None:
    items = [GenerationItem(prompt="2+2=", answer="4")]
    suite = PassAtKSuite(
        items, n=16, ks=(1,), temperature=1.0, max_new_tokens=2, sampler=SeededSampler(7)
    )
    model = _two_answer_model(0.5)
    first = suite.run(model)
    passes = list(suite.last_passes)
    assert suite.run(model) == first and suite.last_passes == passes
    assert 0 < passes[0] < 16  # it really samples


def test_pass_at_k_rejects_k_above_n() -> None:
    with pytest.raises(EvaluationError, match=r"every k must lie in \[1, n=4\]"):
        PassAtKSuite([GenerationItem(prompt="x", answer="y")], n=4, ks=(1, 5))


# --- grounding and media gain -------------------------------------------------------------


class _FixedBox:
    def __init__(self, box: tuple[float, ...]) -> None:
        self.box = box

    def predict_box(self, image: np.ndarray | None, prompt: str) -> tuple[float, ...]:
        return self.box


def _raster_iou(a: tuple[float, ...], b: tuple[float, ...], size: int = 64) -> float:
    grid_y, grid_x = np.mgrid[0:size, 0:size] + 0.5  # pixel centres

    def mask(box: tuple[float, ...]) -> np.ndarray:
        return (grid_x > box[0]) & (grid_x < box[2]) & (grid_y > box[1]) & (grid_y < box[3])

    ma, mb = mask(a), mask(b)
    return float((ma & mb).sum() / (ma | mb).sum())


def test_grounding_iou_against_pixel_counts() -> None:
    items = [
        GroundingItem(image_seed=1, prompt="p", box=(0.0, 0.0, 10.0, 10.0)),
        GroundingItem(image_seed=2, prompt="p", box=(20.0, 20.0, 30.0, 24.0)),
        GroundingItem(image_seed=3, prompt="p", box=(5.0, 5.0, 15.0, 15.0)),
    ]
    predicted = (5.0, 5.0, 15.0, 15.0)
    [score] = GroundingSuite(items).run(EvalModel(module=_FixedBox(predicted)))
    expected = np.mean([_raster_iou(predicted, item.box) for item in items])
    assert expected == pytest.approx((25 / 175 + 0 + 1) / 3)
    assert (score.metric, score.n_items) == ("iou", 3)
    assert score.value == pytest.approx(expected, abs=1e-12)


def test_malformed_box_scores_zero() -> None:
    items = [GroundingItem(image_seed=1, prompt="p", box=(0.0, 0.0, 4.0, 4.0))]
    [score] = GroundingSuite(items).run(EvalModel(module=_FixedBox((3.0, 0.0, 1.0, 4.0))))
    assert score.value == 0.0


def test_media_gain_is_positive_when_the_model_uses_the_image() -> None:
    items = make_grounding_set(12, seed=3)
    suite = MediaGain(GroundingSuite(items))
    scores = {s.metric: s.value for s in suite.run(EvalModel(module=ThresholdBoxPredictor()))}
    assert scores["iou_with_media"] == 1.0  # thresholding recovers the rectangles exactly
    assert scores["iou_without_media"] < 0.3
    assert scores["iou_media_gain"] == pytest.approx(1.0 - scores["iou_without_media"])
    assert scores["iou_media_gain"] > 0.7
    assert suite.versions(EvalModel(module=None)).suite == "grounding/v1+media-gain/v1"


def test_media_gain_is_zero_when_the_model_ignores_the_image() -> None:
    items = make_grounding_set(12, seed=3)
    blind = EvalModel(module=ThresholdBoxPredictor(use_media=False))
    scores = {s.metric: s.value for s in MediaGain(GroundingSuite(items)).run(blind)}
    assert scores["iou_with_media"] == scores["iou_without_media"]
    assert scores["iou_media_gain"] == 0.0


def test_media_gain_refuses_a_lower_is_better_suite() -> None:
    with pytest.raises(EvaluationError, match="media gain needs a higher-is-better suite"):
        MediaGain(HeldoutSuite([HeldoutDoc(text="x", source="u")]))


def test_media_switch_reaches_the_language_model_call() -> None:
    """With media on, the model gets ``media=``; switched off, it is called without."""
    seen: list[object] = []

    class Recorder(torch.nn.Module):
        def forward(self, tokens: torch.Tensor, media: object = None) -> torch.Tensor:
            seen.append(media)
            return torch.zeros(*tokens.shape, 257, dtype=torch.float64)

    model = EvalModel(module=Recorder(), tokenizer=ByteTokenizer(), context_len=8)
    tokens = torch.zeros((1, 3), dtype=torch.long)
    model.logits(tokens, media="image")
    model.with_media(False).logits(tokens, media="image")
    assert seen == ["image", None]
