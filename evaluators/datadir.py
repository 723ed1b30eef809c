"""The evaluator's data directory: which file feeds which suite, and the demo sets.

    heldout.jsonl     held-out text      -> heldout
    choice.jsonl      multiple choice    -> choice
    generation.jsonl  generation         -> generation, pass_at_k
    grounding.jsonl   grounding          -> grounding, grounding_media

Formats are those of ``datasets``. ``ensure_demo_datasets`` writes the missing files
from text that ships with Python (and procedural images); it never overwrites a file,
so a directory holding your own sets keeps them. Held-out text and choice questions
skip the standard-library modules the demo model trains on (``datasets.DEMO_CORPUS_MODULES``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from . import datasets
from .images import make_grounding_set
from .records import DEFAULT_SUITES, SUITE_NAMES, EvaluationError
from .suites import (
    ChoiceSuite,
    GenerationSuite,
    GroundingSuite,
    HeldoutSuite,
    MediaGain,
    PassAtKSuite,
    Suite,
)

__all__ = [
    "DATA_FILES",
    "DEFAULT_SUITES",
    "SUITE_NAMES",
    "build_suites",
    "check_suite_names",
    "ensure_demo_datasets",
]

log = logging.getLogger(__name__)

DATA_FILES = {
    "heldout": "heldout.jsonl",
    "choice": "choice.jsonl",
    "generation": "generation.jsonl",
    "grounding": "grounding.jsonl",
}
_SUITE_DATA = {
    "heldout": "heldout",
    "choice": "choice",
    "generation": "generation",
    "pass_at_k": "generation",
    "grounding": "grounding",
    "grounding_media": "grounding",
}
_DEMO_SIZES = {"heldout": 24, "choice": 32, "generation": 32, "grounding": 32}


def ensure_demo_datasets(data_dir: str | Path, *, seed: int = 0) -> list[Path]:
    """Write every missing demo set into ``data_dir``; return the files written."""
    root = Path(data_dir)
    exclude = datasets.DEMO_CORPUS_MODULES  # text the demo model trained on
    makers = {
        "heldout": lambda n: datasets.make_heldout_text(n, seed, exclude_modules=exclude),
        "choice": lambda n: datasets.make_choice_set(n, seed, exclude_modules=exclude),
        "generation": lambda n: datasets.make_generation_set(n, seed),
        "grounding": lambda n: make_grounding_set(n, seed),
    }
    written: list[Path] = []
    for kind, filename in DATA_FILES.items():
        path = root / filename
        if path.exists():
            continue
        count = datasets.write_jsonl(path, makers[kind](_DEMO_SIZES[kind]))
        log.info("wrote demo %s set %s (%d records)", kind, path, count)
        written.append(path)
    return written


def _load(kind: str, path: Path) -> list:
    loader = {
        "heldout": datasets.load_heldout_text,
        "choice": datasets.load_choice_set,
        "generation": datasets.load_generation_set,
        "grounding": datasets.load_grounding_set,
    }[kind]
    try:
        return loader(path)
    except datasets.DatasetError as exc:
        raise EvaluationError(f"{kind} data: {exc}") from None


def check_suite_names(names: Sequence[str]) -> None:
    """``EvaluationError`` unless ``names`` is a non-empty list of ``SUITE_NAMES``."""
    unknown = [n for n in names if n not in SUITE_NAMES]
    if unknown or not names:
        raise EvaluationError(
            f"unknown suite(s) {unknown or list(names)}; known: {', '.join(SUITE_NAMES)}"
        )


def build_suites(names: Sequence[str], data_dir: str | Path) -> list[Suite]:
    """The named suites (``SUITE_NAMES``) with their default parameters, fed from
    ``data_dir``. Raises ``EvaluationError`` for an unknown name or unusable data."""
    check_suite_names(names)
    root = Path(data_dir)
    cache: dict[str, list] = {}

    def items(name: str) -> list:
        kind = _SUITE_DATA[name]
        if kind not in cache:
            cache[kind] = _load(kind, root / DATA_FILES[kind])
        return cache[kind]

    build = {
        "heldout": lambda: HeldoutSuite(items("heldout")),
        "choice": lambda: ChoiceSuite(items("choice")),
        "generation": lambda: GenerationSuite(items("generation")),
        "pass_at_k": lambda: PassAtKSuite(items("pass_at_k")),
        "grounding": lambda: GroundingSuite(items("grounding")),
        "grounding_media": lambda: MediaGain(GroundingSuite(items("grounding_media"))),
    }
    return [build[name]() for name in dict.fromkeys(names)]
