"""Tests for probewire.evaluators.lm: tokenizer, factory paths, windows, decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from probewire.evaluators import ByteTokenizer, EvalModel, EvaluationError, Tokenizer
from probewire.evaluators.lm import (
    NullProgress,
    _windows,
    accepts_keyword,
    continuation_nlls,
    generate,
    resolve_callable,
)
from probewire.evaluators.testing import BigramLM


def test_byte_tokenizer_round_trips_utf8_and_skips_bos() -> None:
    tok = ByteTokenizer()
    text = "naïve 中文 😀"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode([tok.bos_id, *ids]) == text
    assert isinstance(tok, Tokenizer)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "expected 'module:function'"),
        ("probewire.no_such_module:f", "module 'probewire.no_such_module' does not import"),
        ("probewire.deploy.demo.model:no_such_fn", "has no attribute 'no_such_fn'"),
        ("probewire.deploy.demo.model:VOCAB", "'VOCAB' is not callable"),
    ],
)
def test_bad_factory_paths_give_one_line_errors(spec: str, message: str) -> None:
    with pytest.raises(EvaluationError, match=message) as info:
        resolve_callable(spec, "model factory")
    assert "\n" not in str(info.value) and str(info.value).startswith("model factory")


def test_factory_path_resolves_dotted_attributes() -> None:
    fn = resolve_callable("probewire.evaluators.lm:ByteTokenizer.decode", "x")
    assert fn is ByteTokenizer.decode


def test_accepts_keyword() -> None:
    def plain(path: str) -> None: ...
    def with_ema(path: str, *, ema: bool = False) -> None: ...
    def anything(path: str, **kwargs: object) -> None: ...

    assert [accepts_keyword(f, "ema") for f in (plain, with_ema, anything)] == [False, True, True]


@pytest.mark.parametrize(
    ("n_ctx", "n_tgt", "context_len"),
    [(0, 1, 4), (0, 9, 4), (3, 2, 4), (10, 7, 4), (2, 30, 8), (0, 8, 8)],
)
def test_windows_score_every_target_once_within_the_context(
    n_ctx: int, n_tgt: int, context_len: int
) -> None:
    context, target = list(range(100, 100 + n_ctx)), list(range(n_tgt))
    windows = _windows(0, context, target, bos=-1, context_len=context_len)
    scored = [t for w in windows for t in w.targets[w.first :]]
    assert scored == target
    seq = context + target
    for w in windows:
        assert w.inputs[0] == -1 and len(w.inputs) == len(w.targets) <= context_len
        # input position p holds the token just before targets[p]
        start = seq.index(w.targets[0])  # token values are unique
        assert w.inputs[1:] == seq[start : start + len(w.targets) - 1]


def test_continuation_nll_is_batch_invariant() -> None:
    table = np.random.default_rng(0).normal(size=(257, 257))
    requests = [
        (list(b"question"), list(b" answer")),
        ((), list(b"a longer document text")),
        (list(b"q"), []),
    ]
    results = []
    for batch_size in (1, 2, 16):
        model = EvalModel(
            module=BigramLM(table), tokenizer=ByteTokenizer(), context_len=6, batch_size=batch_size
        )
        results.append(continuation_nlls(model, requests, NullProgress()))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)
    assert [len(r) for r in results[0]] == [7, 22, 0]


def test_generation_stops_per_row_at_the_stop_string() -> None:
    table = np.zeros((257, 257))
    table[ord("a"), ord("b")] = 9.0  # a -> b -> newline; x -> x -> x ...
    table[ord("b"), ord("\n")] = 9.0
    table[ord("x"), ord("x")] = 9.0
    model = EvalModel(module=BigramLM(table), tokenizer=ByteTokenizer(), context_len=4)
    out = generate(
        model, [list(b"a"), list(b"x")], max_new_tokens=5, stop="\n", progress=NullProgress()
    )
    assert out == [list(b"b\n"), list(b"xxxxx")]


def test_sampling_without_a_sampler_is_refused() -> None:
    model = EvalModel(
        module=BigramLM(np.zeros((257, 257))), tokenizer=ByteTokenizer(), context_len=4
    )
    with pytest.raises(ValueError, match="needs a sampler"):
        generate(
            model, [[1]], max_new_tokens=1, stop=None, progress=NullProgress(), temperature=1.0
        )


def test_model_without_context_length_is_a_clear_error() -> None:
    model = EvalModel(module=BigramLM(np.zeros((257, 257))), tokenizer=ByteTokenizer())
    with pytest.raises(
        EvaluationError, match="needs a language model with a tokenizer and a context length"
    ):
        continuation_nlls(model, [((), [1])], NullProgress())


def test_huggingface_style_outputs_are_unwrapped() -> None:
    class Out:
        def __init__(self, logits: torch.Tensor) -> None:
            self.logits = logits

    class HF(torch.nn.Module):
        def forward(self, tokens: torch.Tensor) -> Out:
            return Out(torch.zeros(*tokens.shape, 257))

    model = EvalModel(module=HF(), tokenizer=ByteTokenizer(), context_len=4)
    [nll] = continuation_nlls(model, [((), [1, 2])], NullProgress())
    np.testing.assert_allclose(nll, [np.log(257)] * 2, rtol=1e-12)
