"""The demo model's optional structures: the default model is unchanged, presets build and
train, media removal is exact, checkpoints round-trip, batches carry variable media."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from probewire.deploy.demo.data import Batch, load_corpus
from probewire.deploy.demo.model import (
    IGNORE,
    PRESETS,
    TinyConfig,
    TinyLM,
    load_checkpoint,
    mtp_targets,
    save_checkpoint,
)

SMALL = dict(seq_len=16, d_model=16, n_head=2, encoder_dim=8)


def test_the_default_model_is_the_plain_dense_model():
    torch.manual_seed(0)
    model = TinyLM(TinyConfig())
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == 2 + 2 * 8 + 3 and not any(
        k in n for n in names for k in ("router", "gate", "encoder", "projector", "mtp")
    )
    assert sum(p.numel() for p in model.parameters()) == 135936
    assert model.flops_per_token() == 913920.0
    tokens = torch.randint(0, 257, (2, 64))
    assert model(tokens).shape == (2, 64, 257)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_trains_and_round_trips(name, tmp_path):
    torch.manual_seed(0)
    cfg = TinyConfig.preset(name, **SMALL)
    model = TinyLM(cfg)
    batch = load_corpus().batch(
        np.random.default_rng(0), 3, cfg.seq_len, 4, media_tiles=cfg.media_tiles
    )
    logits, mtp = model(batch.tokens, batch.media, batch.media_mask, return_mtp=True)
    assert logits.shape == (3, cfg.seq_len, cfg.vocab) and len(mtp) == cfg.mtp_depth
    loss = F.cross_entropy(
        logits.reshape(-1, cfg.vocab), batch.targets.reshape(-1), ignore_index=IGNORE
    )
    for k, z in enumerate(mtp, 1):
        loss = loss + F.cross_entropy(
            z.reshape(-1, cfg.vocab), mtp_targets(batch.targets, k).reshape(-1), ignore_index=IGNORE
        )
    loss.backward()
    if cfg.n_experts:  # the attached balancing loss reaches the router
        assert model.blocks[0].mlp.router.weight.grad.abs().sum() > 0
    save_checkpoint(model, tmp_path / "m.pt")
    loaded = load_checkpoint(tmp_path / "m.pt")
    assert loaded.cfg == cfg
    with torch.no_grad():
        model.eval()
        assert torch.equal(
            loaded(batch.tokens, batch.media, batch.media_mask),
            model(batch.tokens, batch.media, batch.media_mask),
        )
    with pytest.raises(ValueError, match="unknown preset"):
        TinyConfig.preset("huge")


def test_absent_images_are_invisible_to_the_text():
    torch.manual_seed(0)
    cfg = TinyConfig.preset("media", **SMALL)
    model = TinyLM(cfg).eval()
    tokens = torch.randint(0, 256, (2, cfg.seq_len))
    media = torch.rand(2, 2, cfg.image_size, cfg.image_size)
    none = torch.zeros(2, 2, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, media, none), model(tokens), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(model(tokens, media, ~none), model(tokens), atol=1e-4)


def test_media_batches_have_variable_length_and_captions_and_old_callers_still_work():
    corpus = load_corpus()
    text_only = corpus.batch(np.random.default_rng(1), 8, 64, 8)
    assert text_only.media is None and text_only.media_mask is None
    assert Batch(text_only.tokens, text_only.targets, text_only.source).media is None
    batch = corpus.batch(np.random.default_rng(1), 8, 64, 8, media_tiles=2)
    assert torch.equal(batch.source, text_only.source)
    counts = batch.media_mask.sum(1)
    assert set(counts.tolist()) > {1} and batch.media.shape == (8, 2, 16, 16)
    assert ((batch.media == 0).flatten(2).all(-1) == ~batch.media_mask).all()
    for row, n in enumerate(counts.tolist()):
        valid = int((batch.targets[row] != IGNORE).sum())
        assert torch.equal(batch.tokens[row, 1:valid], batch.targets[row, : valid - 1])
        if n:
            assert batch.targets[row, 0] == ord("<")
