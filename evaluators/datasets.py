"""Evaluation data sets: JSONL formats, loaders, and generators from stdlib text.

Every file is UTF-8 JSON Lines, one object per line. Blank lines are skipped and
keys other than those below are ignored. Formats (seeds 001 §10):

    held-out text    {"text": str, "source": str}
    multiple choice  {"question": str, "options": [str, ...], "answer": int}
    generation       {"prompt": str, "answer": str}
    grounding        {"image_seed": int, "prompt": str, "box": [x0, y0, x1, y1]}

``text``, ``question``, ``prompt`` and every option are non-empty; options are
distinct, at least two, and ``answer`` indexes them from 0. ``box`` has
x1 >= x0 and y1 >= y0. A choice option is scored as the continuation of its
question after one space. Loaders raise ``DatasetError`` naming the file and line.

The generators build small real sets from docstrings in the running Python's
standard-library sources (parsed with ``ast``, nothing imported or downloaded).
Output is fixed by ``seed`` and the Python version, which ``source`` records.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import math
import os
import random
import re
import sys
import sysconfig
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ChoiceItem",
    "DatasetError",
    "GenerationItem",
    "GroundingItem",
    "HeldoutDoc",
    "load_choice_set",
    "load_generation_set",
    "load_grounding_set",
    "load_heldout_text",
    "make_choice_set",
    "make_generation_set",
    "make_heldout_text",
    "write_jsonl",
]


class DatasetError(ValueError):
    """A data set file that cannot be used; ``line`` is None for whole-file problems."""

    def __init__(self, path: str | os.PathLike[str], line: int | None, reason: str) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.reason = reason
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {reason}")


@dataclass(kw_only=True, slots=True, frozen=True)
class HeldoutDoc:
    """One held-out document; its NLL and UTF-8 bytes feed NLL/PPL and BPB."""

    text: str
    source: str


@dataclass(kw_only=True, slots=True, frozen=True)
class ChoiceItem:
    """One multiple-choice question; ``answer`` is the index of the right option."""

    question: str
    options: tuple[str, ...]
    answer: int


@dataclass(kw_only=True, slots=True, frozen=True)
class GenerationItem:
    """One greedy-generation task with its exact reference answer."""

    prompt: str
    answer: str


@dataclass(kw_only=True, slots=True, frozen=True)
class GroundingItem:
    """One grounding task: a procedural image (by seed), a prompt, the true box."""

    image_seed: int
    prompt: str
    box: tuple[float, float, float, float]


Record = HeldoutDoc | ChoiceItem | GenerationItem | GroundingItem
_T = TypeVar("_T")


class _RecordError(Exception):
    """A field problem in one record; the loader adds file and line."""


def _text(obj: dict[str, Any], key: str, *, allow_empty: bool = False) -> str:
    if key not in obj:
        raise _RecordError(f"missing field '{key}'")
    value = obj[key]
    if not isinstance(value, str):
        raise _RecordError(f"field '{key}' must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise _RecordError(f"field '{key}' is empty")
    return value


def _integer(obj: dict[str, Any], key: str) -> int:
    if key not in obj:
        raise _RecordError(f"missing field '{key}'")
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise _RecordError(f"field '{key}' must be an integer, got {value!r}")
    return value


def _parse_heldout(obj: dict[str, Any]) -> HeldoutDoc:
    return HeldoutDoc(text=_text(obj, "text"), source=_text(obj, "source", allow_empty=True))


def _parse_choice(obj: dict[str, Any]) -> ChoiceItem:
    question = _text(obj, "question")
    if "options" not in obj:
        raise _RecordError("missing field 'options'")
    options = obj["options"]
    if not isinstance(options, list) or len(options) < 2:
        raise _RecordError("field 'options' must be a list of at least 2 strings")
    if not all(isinstance(o, str) and o for o in options):
        raise _RecordError("every option must be a non-empty string")
    if len(set(options)) != len(options):
        raise _RecordError("options must be distinct")
    answer = _integer(obj, "answer")
    if not 0 <= answer < len(options):
        raise _RecordError(f"answer {answer} is not an index into {len(options)} options")
    return ChoiceItem(question=question, options=tuple(options), answer=answer)


def _parse_generation(obj: dict[str, Any]) -> GenerationItem:
    answer = _text(obj, "answer", allow_empty=True)
    return GenerationItem(prompt=_text(obj, "prompt"), answer=answer)


def _parse_grounding(obj: dict[str, Any]) -> GroundingItem:
    image_seed = _integer(obj, "image_seed")
    if image_seed < 0:
        raise _RecordError(f"field 'image_seed' must be >= 0, got {image_seed}")
    prompt = _text(obj, "prompt")
    box = obj.get("box")
    if not isinstance(box, list) or len(box) != 4:
        raise _RecordError("field 'box' must be a list [x0, y0, x1, y1]")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in box):
        raise _RecordError("box coordinates must be numbers")
    x0, y0, x1, y1 = (float(v) for v in box)
    if not all(math.isfinite(v) for v in (x0, y0, x1, y1)):
        raise _RecordError("box coordinates must be finite")
    if x1 < x0 or y1 < y0:
        raise _RecordError(f"box needs x1 >= x0 and y1 >= y0, got {box}")
    return GroundingItem(image_seed=image_seed, prompt=prompt, box=(x0, y0, x1, y1))


def _read_jsonl(path: str | os.PathLike[str], parse: Callable[[dict[str, Any]], _T]) -> list[_T]:
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise DatasetError(path, None, f"cannot open: {exc.strerror}") from exc
    rows: list[_T] = []
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(path, lineno, "not valid UTF-8") from exc
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(path, lineno, f"malformed JSON: {exc.msg}") from exc
            if not isinstance(obj, dict):
                raise DatasetError(path, lineno, "expected a JSON object")
            try:
                rows.append(parse(obj))
            except _RecordError as exc:
                raise DatasetError(path, lineno, str(exc)) from None
    if not rows:
        raise DatasetError(path, None, "empty data set: no records")
    return rows


def load_heldout_text(path: str | os.PathLike[str]) -> list[HeldoutDoc]:
    """Read a held-out text set: ``{"text": str, "source": str}`` per line."""
    return _read_jsonl(path, _parse_heldout)


def load_choice_set(path: str | os.PathLike[str]) -> list[ChoiceItem]:
    """Read a multiple-choice set: ``{"question", "options", "answer"}`` per line."""
    return _read_jsonl(path, _parse_choice)


def load_generation_set(path: str | os.PathLike[str]) -> list[GenerationItem]:
    """Read a generation set: ``{"prompt": str, "answer": str}`` per line."""
    return _read_jsonl(path, _parse_generation)


def load_grounding_set(path: str | os.PathLike[str]) -> list[GroundingItem]:
    """Read a grounding set: ``{"image_seed", "prompt", "box"}`` per line."""
    return _read_jsonl(path, _parse_grounding)


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Record]) -> int:
    """Write records as UTF-8 JSONL (atomically, via a temporary file); return the count.

    Refuses an empty set, which no loader would accept.
    """
    lines = [json.dumps(dataclasses.asdict(row), ensure_ascii=False) + "\n" for row in rows]
    if not lines:
        raise ValueError(f"refusing to write an empty data set to {os.fspath(path)}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, target)
    return len(lines)


# --- generators from standard-library docstrings ----------------------------------

DEMO_CORPUS_MODULES = (
    "json", "collections", "functools", "itertools", "pathlib", "argparse", "textwrap",
    "string", "re", "heapq", "bisect", "statistics", "fractions", "decimal", "datetime",
    "calendar", "random", "math", "os", "shutil", "subprocess", "logging", "typing",
    "dataclasses", "enum", "csv", "abc", "contextlib", "operator", "copy",
)  # fmt: skip
"""The standard-library modules whose docstrings and sources the demo model trains on
(``probewire.deploy.demo.data`` reads them from here); the demo held-out and choice sets
leave them out (``datadir.ensure_demo_datasets``)."""

_STDLIB_MODULES = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "email", "fnmatch", "fractions", "ftplib", "functools",
    "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "imaplib", "ipaddress", "json",
    "locale", "logging", "mailbox", "netrc", "numbers", "optparse", "pathlib", "pickle",
    "pprint", "queue", "quopri", "random", "secrets", "shlex", "shutil", "smtplib",
    "statistics", "string", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "traceback", "uuid", "warnings", "wave", "weakref", "zipfile",
)  # fmt: skip
_SOURCE_TAG = f"python{sys.version_info.major}.{sys.version_info.minor}-stdlib"
_MIN_DOC_CHARS = 200
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")
_PLAIN_SENTENCE = re.compile(r"[A-Z][A-Za-z0-9 ,;'()-]+\.")
_WORD = re.compile(r"\b[a-z]{4,12}\b")


def _module_file(root: Path, name: str) -> Path | None:
    for candidate in (root / f"{name}.py", root / name / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def _stdlib_docstrings() -> tuple[tuple[str, str], ...]:
    """(qualified name, docstring) for public modules, classes, functions, methods."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, str]] = []
    for name in _STDLIB_MODULES:
        path = _module_file(root, name)
        if path is None:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes: list[tuple[str, ast.Module | ast.ClassDef | ast.FunctionDef]] = [(name, tree)]
        for node in tree.body:
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and not node.name.startswith("_"):
                nodes.append((f"{name}.{node.name}", node))
                if isinstance(node, ast.ClassDef):
                    nodes.extend(
                        (f"{name}.{node.name}.{sub.name}", sub)
                        for sub in node.body
                        if isinstance(sub, ast.FunctionDef) and not sub.name.startswith("_")
                    )
        for qualname, node in nodes:
            doc = ast.get_docstring(node)
            if doc:
                found.append((qualname, doc))
    return tuple(found)


def _module_of(qualname: str) -> str:
    return qualname.split(".", 1)[0]


@functools.cache
def _sentences(exclude: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Plain prose sentences of 8 to 30 words, whitespace collapsed, first occurrence kept.

    Docstrings of the modules in ``exclude`` are skipped.
    """
    seen: dict[str, None] = {}
    for qualname, doc in _stdlib_docstrings():
        if _module_of(qualname) in exclude:
            continue
        for paragraph in doc.split("\n\n"):
            for sentence in _SENTENCE_SPLIT.split(" ".join(paragraph.split())):
                if _PLAIN_SENTENCE.fullmatch(sentence) and 8 <= len(sentence.split()) <= 30:
                    seen.setdefault(sentence, None)
    return tuple(seen)


def _split_sentence(sentence: str) -> tuple[str, str]:
    words = sentence.split()
    cut = len(words) // 2
    return " ".join(words[:cut]), " ".join(words[cut:])


def _check_count(name: str, n: int, available: int | None) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{name} must be an int >= 1, got {n!r}")
    if available is not None and n > available:
        raise ValueError(f"{name}={n} exceeds the {available} items this Python can supply")


def make_heldout_text(
    n_docs: int, seed: int, *, exclude_modules: Collection[str] = ()
) -> list[HeldoutDoc]:
    """``n_docs`` distinct stdlib docstrings of at least 200 characters, chosen by ``seed``.

    ``exclude_modules`` (top-level module names) keeps text a model trained on out of
    the held-out set.
    """
    skip = frozenset(exclude_modules)
    pool = [
        (q, d)
        for q, d in _stdlib_docstrings()
        if len(d) >= _MIN_DOC_CHARS and _module_of(q) not in skip
    ]
    _check_count("n_docs", n_docs, len(pool))
    chosen = random.Random(seed).sample(pool, n_docs)
    return [HeldoutDoc(text=doc, source=f"{_SOURCE_TAG}:{q}") for q, doc in chosen]


def make_choice_set(
    n: int, seed: int, n_options: int = 4, *, exclude_modules: Collection[str] = ()
) -> list[ChoiceItem]:
    """Sentence completion: the first half of a docstring sentence is the question.

    The right option is the sentence's own second half; the distractors are second
    halves of other sentences. Option order is shuffled by ``seed``. Sentences from
    ``exclude_modules`` are not used.
    """
    if not isinstance(n_options, int) or n_options < 2:
        raise ValueError(f"n_options must be an int >= 2, got {n_options!r}")
    pool = _sentences(frozenset(exclude_modules))
    _check_count("n", n, len(pool))
    endings = sorted({_split_sentence(s)[1] for s in pool})
    if len(endings) < n_options:
        raise ValueError(f"only {len(endings)} distinct endings for {n_options} options")
    rng = random.Random(seed)
    items: list[ChoiceItem] = []
    for sentence in rng.sample(pool, n):
        question, right = _split_sentence(sentence)
        options = [right]
        while len(options) < n_options:
            candidate = rng.choice(endings)
            if candidate not in options:
                options.append(candidate)
        rng.shuffle(options)
        answer = options.index(right)
        items.append(ChoiceItem(question=question, options=tuple(options), answer=answer))
    return items


def make_generation_set(n: int, seed: int) -> list[GenerationItem]:
    """Tasks with one exact answer: "Repeat the word: W" -> W, or "a+b=" -> str(a + b).

    Words are lower-case words of 4 to 12 letters from stdlib docstrings; a and b
    are in 0..99. Each task kind is drawn with probability 1/2.
    """
    words = sorted({w for s in _sentences() for w in _WORD.findall(s)})
    _check_count("n", n, None)
    rng = random.Random(seed)
    items: list[GenerationItem] = []
    for _ in range(n):
        if rng.random() < 0.5:
            word = rng.choice(words)
            items.append(GenerationItem(prompt=f"Repeat the word: {word}\nAnswer:", answer=word))
        else:
            x, y = rng.randint(0, 99), rng.randint(0, 99)
            items.append(GenerationItem(prompt=f"{x}+{y}=", answer=str(x + y)))
    return items
