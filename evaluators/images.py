"""Procedural images for the grounding suite, and a reference box predictor.

The demo has no media model yet; grounding is defined against a model protocol,
``predict_box(image, prompt) -> (x0, y0, x1, y1)``, where ``image`` is a float32
``[size, size]`` array in [0, 1] or None (media removed). Boxes are in pixel-edge
coordinates: a rectangle covering pixels x0..x1−1 and y0..y1−1 is ``(x0, y0, x1, y1)``.

Image ``image_seed`` holds two non-overlapping rectangles on faint noise: a bright one
(value 1.0) and a dim one (0.5). A grounding item asks for one of them by name. The
renderer is a pure function of ``(image_seed, size)`` (NumPy PCG64), so a data set
stores only seeds and boxes. ``IMAGE_VERSION`` goes into the suite's prompt version.
"""

from __future__ import annotations

import random

import numpy as np

from .datasets import GroundingItem

__all__ = ["IMAGE_VERSION", "make_grounding_set", "render_image"]

IMAGE_VERSION = "procedural-two-rects/v1"
_TARGETS = ("bright", "dim")
_LEVELS = {"bright": 1.0, "dim": 0.5}

Box = tuple[float, float, float, float]


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def render_image(image_seed: int, size: int = 32) -> tuple[np.ndarray, dict[str, Box]]:
    """The image for ``image_seed`` and the boxes of its "bright" and "dim" rectangles."""
    if size < 16:
        raise ValueError(f"size must be >= 16, got {size}")
    rng = np.random.default_rng(image_seed)
    image = rng.uniform(0.0, 0.1, size=(size, size)).astype(np.float32)
    boxes: dict[str, Box] = {}
    for name in _TARGETS:
        while True:
            w, h = (int(v) for v in rng.integers(size // 8, size // 3 + 1, size=2))
            x0, y0 = int(rng.integers(0, size - w + 1)), int(rng.integers(0, size - h + 1))
            box = (float(x0), float(y0), float(x0 + w), float(y0 + h))
            if not any(_overlaps(box, other) for other in boxes.values()):
                break
        boxes[name] = box
        image[y0 : y0 + h, x0 : x0 + w] = _LEVELS[name]
    return image, boxes


def make_grounding_set(n: int, seed: int, size: int = 32) -> list[GroundingItem]:
    """``n`` grounding items over procedural images; the target rectangle is drawn by seed."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    rng = random.Random(seed)
    items: list[GroundingItem] = []
    for _ in range(n):
        image_seed = rng.randrange(2**31)
        target = rng.choice(_TARGETS)
        _, boxes = render_image(image_seed, size)
        items.append(
            GroundingItem(
                image_seed=image_seed, prompt=f"Find the {target} rectangle.", box=boxes[target]
            )
        )
    return items
