"""The label-shuffle fault (a broken data shard, issue 38): from its step on, the chosen rows
of one rank's batch carry the previous row's targets where both are valid; padding stays
padding, the inputs stay the real text, other ranks and earlier steps are untouched."""

from __future__ import annotations

import torch

from probewire.deploy.demo.data import Batch
from probewire.deploy.demo.faults import MANY_RANKS, LabelShuffle, parse_fault
from probewire.deploy.demo.model import IGNORE


def batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 256, (8, 12), generator=g)
    targets[3, 9:] = IGNORE  # a padded row
    return Batch(tokens=targets.clone(), targets=targets, source=torch.zeros(8, dtype=torch.long))


def test_chosen_rows_get_the_previous_rows_valid_labels_from_the_step_on():
    fault = parse_fault("label-shuffle@5:rank=2,fraction=1.0")
    assert isinstance(fault, LabelShuffle) and "label-shuffle" in MANY_RANKS
    b = batch()
    assert fault.on_batch(4, 2, b) is b and fault.on_batch(5, 1, b) is b
    got = fault.on_batch(5, 2, b)
    prev = torch.roll(b.targets, 1, dims=0)
    valid = (b.targets != IGNORE) & (prev != IGNORE)
    assert torch.equal(got.targets[valid], prev[valid])
    assert torch.equal(got.targets[~valid], b.targets[~valid])  # padding stays padding
    assert torch.equal(got.tokens, b.tokens)  # the inputs are the real text


def test_a_fraction_shuffles_only_some_rows():
    got = parse_fault("label-shuffle@0:rank=0,fraction=0.5").on_batch(7, 0, batch())
    changed = (got.targets != batch().targets).any(dim=1)
    assert 0 < int(changed.sum()) < 8
