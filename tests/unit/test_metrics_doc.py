"""docs/metrics.md covers the catalog and resolves every seed citation in production code.

Everything is read from this checkout (paths relative to this file): the catalog module is
executed from its own source file, not imported through the installed package, so the
test checks the tree it sits in.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "metrics.md"
PRODUCTION = ("instrument", "stream", "sinks", "evaluators", "deploy")

# "seeds 001 §4", "001 §4", "001 §3-§6", "001 §4, §6", "001 §0, §12"; a bare "seeds §6"
# (older docstrings) means seed 001.
_MORE = r"((?:\s*(?:,|-|–|and)\s*§\s*\d+)*)"
_CITED = re.compile(r"\b(\d{3})\s*§\s*(\d+)" + _MORE)
_BARE = re.compile(r"\bseeds\s+§\s*(\d+)" + _MORE)
_HEADING = re.compile(r"^#{2,6} (\d{3}) §(\d+)(?!\d)", re.M)


def _catalog_names() -> set[str]:
    """The metric names of this checkout's ``instrument/catalog.py`` (torch-free, stdlib
    imports only), executed from its file under a private module name."""
    path = ROOT / "instrument" / "catalog.py"
    name = "_metrics_doc_catalog"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    try:
        spec.loader.exec_module(module)
        return set(module.CATALOG)
    finally:
        del sys.modules[name]


def _sections(first: int, more: str) -> set[int]:
    """``§first`` and the ``, §k`` / ``-§k`` that follow it (a range is every section in it)."""
    found = {first}
    prev = first
    for sep, k in re.findall(r"(,|-|–|and)\s*§\s*(\d+)", more):
        k = int(k)
        found.update(range(prev, k + 1) if sep in "-–" else (k,))
        prev = k
    return found


def citations(text: str) -> set[tuple[str, int]]:
    """Every (seed, section) a text cites."""
    out: set[tuple[str, int]] = set()
    for seed, first, more in _CITED.findall(text):
        out.update((seed, k) for k in _sections(int(first), more))
    for first, more in _BARE.findall(text):
        out.update(("001", k) for k in _sections(int(first), more))
    return out


def _production_citations() -> dict[tuple[str, int], str]:
    """(seed, section) -> the first production file citing it."""
    cited: dict[tuple[str, int], str] = {}
    for package in PRODUCTION:
        for path in sorted((ROOT / package).rglob("*.py")):
            for key in citations(path.read_text(encoding="utf-8")):
                cited.setdefault(key, str(path.relative_to(ROOT)))
    return cited


def test_citation_forms_parse() -> None:
    """The citation forms the code uses resolve to the sections they name."""
    assert citations("seeds 001 §4, and 002 act/x") == {("001", 4)}
    assert citations("(seeds 001 §3-§6, summary 000)") == {("001", k) for k in (3, 4, 5, 6)}
    assert citations("001 §0, §12 and 001 §4, §6") == {
        ("001", 0),
        ("001", 12),
        ("001", 4),
        ("001", 6),
    }
    assert citations("points of seeds §6 ") == {("001", 6)}
    assert citations("1,000 steps; 2,000 ranks; step 100") == set()


def test_every_catalog_metric_is_documented() -> None:
    """Each metric name of instrument/catalog.py appears in docs/metrics.md as `name`."""
    names = _catalog_names()
    assert len(names) > 50  # the catalog was read, not an empty set
    doc = DOC.read_text(encoding="utf-8")
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/metrics.md does not define {missing}"


def test_every_seed_citation_has_a_heading() -> None:
    """Each `seeds NNN §K` / `NNN §K` cited in instrument/, stream/, sinks/, evaluators/ or
    deploy/ is a heading `NNN §K ...` in docs/metrics.md."""
    cited = _production_citations()
    assert len(cited) >= 10  # the scan found the code's citations
    headings = {(seed, int(k)) for seed, k in _HEADING.findall(DOC.read_text(encoding="utf-8"))}
    unresolved = {
        f"{seed} §{k}": where for (seed, k), where in cited.items() if (seed, k) not in headings
    }
    assert not unresolved, f"citations without a heading in docs/metrics.md: {unresolved}"


@pytest.mark.parametrize("seed,section", [("001", k) for k in range(13)])
def test_seed_001_sections_all_have_headings(seed: str, section: int) -> None:
    """Every section of the English reference (001 §0 priorities … §12 probe cost) has its
    heading, cited or not yet."""
    headings = set(_HEADING.findall(DOC.read_text(encoding="utf-8")))
    assert (seed, str(section)) in headings
