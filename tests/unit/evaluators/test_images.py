"""Tests for probewire.evaluators.images: procedural grounding images."""

from __future__ import annotations

import numpy as np

from probewire.evaluators import ThresholdBoxPredictor, make_grounding_set, render_image


def test_render_is_deterministic_and_draws_the_boxes() -> None:
    image, boxes = render_image(42)
    again, same = render_image(42)
    assert np.array_equal(image, again) and boxes == same
    assert image.shape == (32, 32) and image.dtype == np.float32
    for name, level in (("bright", 1.0), ("dim", 0.5)):
        x0, y0, x1, y1 = (int(v) for v in boxes[name])
        assert (image[y0:y1, x0:x1] == level).all()
        assert (image == level).sum() == (x1 - x0) * (y1 - y0)  # nowhere else
    bright, dim = boxes["bright"], boxes["dim"]
    assert bright[2] <= dim[0] or dim[2] <= bright[0] or bright[3] <= dim[1] or dim[3] <= bright[1]


def test_grounding_set_boxes_match_the_rendered_target() -> None:
    items = make_grounding_set(20, seed=5)
    assert items == make_grounding_set(20, seed=5)
    assert {item.prompt for item in items} == {
        "Find the bright rectangle.",
        "Find the dim rectangle.",
    }
    predictor = ThresholdBoxPredictor()
    for item in items:
        image, boxes = render_image(item.image_seed)
        target = "bright" if "bright" in item.prompt else "dim"
        assert item.box == boxes[target]
        assert predictor.predict_box(image, item.prompt) == item.box
        assert predictor.predict_box(None, item.prompt) == (8.0, 8.0, 24.0, 24.0)
