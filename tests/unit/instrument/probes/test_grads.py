"""The gradient probe's norm and clip indicator against clip_grad_norm_ and float64."""

from __future__ import annotations

import math

import pytest
import torch
from probe_helpers import host

from probewire.instrument.probes.grads import decode_norms, grad_norms


def test_grad_norm_reproduces_clip_grad_norm_and_float64_reference():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in ((7, 5), (300,), (3, 3, 3))]
    for p in params:
        p.grad = torch.randn_like(p) * 3
    vec = grad_norms([p.grad for p in params], None)
    [point] = decode_norms([(host(vec), None)])
    ref = sum(float((p.grad.double() ** 2).sum()) for p in params)
    clip = float(torch.nn.utils.clip_grad_norm_(params, 1e9))
    assert point.value == pytest.approx(ref, rel=1e-6)
    assert math.sqrt(point.value) == pytest.approx(clip, rel=1e-12)


def test_grad_norm_removes_the_loss_scale_and_derives_the_clip_indicator():
    g = [torch.full((10,), 2.0), torch.full((6,), -1.0)]
    vec = grad_norms([t * 1024.0 for t in g], torch.tensor(1 / 1024.0, dtype=torch.float64))
    points = {p.name: p.value for p in decode_norms([(host(vec), 5.0)])}
    assert points["grad.norm_sq"] == pytest.approx(46.0, rel=1e-6)  # float32 norms
    assert points["grad.clipped"] == 1.0  # sqrt(46) > 5
    points = {p.name: p.value for p in decode_norms([(host(vec), 7.0)])}
    assert points["grad.clipped"] == 0.0


def test_grad_norm_with_an_inf_element_is_non_finite():
    vec = grad_norms([torch.tensor([1.0, float("inf")]), torch.ones(3)], None)
    [point] = decode_norms([(host(vec), None)])
    assert point.value == math.inf
