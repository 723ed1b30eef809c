"""The package layering, read from the import statements (ast): ``deploy`` is the only
composition root, so no other package imports it; ``instrument`` (the rank side) and
``evaluators`` never import ``stream`` (what they share with it is in
``instrument.plumbing``); and no package hides such an edge in an import by string
(``"probewire.deploy.demo.model:load_checkpoint"``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "stream": {"probewire.deploy"},
    "sinks": {"probewire.deploy"},
    "evaluators": {"probewire.deploy", "probewire.stream"},
    "instrument": {"probewire.deploy", "probewire.stream"},
}

# Known violations, to be removed by their owners (none today). A new violation fails; a
# fixed one must leave here.
KNOWN: dict[str, set[str]] = {}


IMPORT_BY_STRING = re.compile(r"(probewire(?:\.\w+)+):\w+")


def imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute module a file imports (relative imports stay in their package), and
    every module a ``"probewire.x.y:name"`` string constant names (an import by string)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = IMPORT_BY_STRING.fullmatch(node.value)
            if match is not None:
                found.append((node.lineno, match.group(1)))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_import(package: str) -> None:
    found = {
        (str(path.relative_to(REPO)), module)
        for path in sorted((REPO / package).rglob("*.py"))
        for _, module in imports(path)
        if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package])
    }
    known = {(f, m) for f, ms in KNOWN.items() if f.startswith(package + "/") for m in ms}
    assert found - known == set(), "upward imports: " + ", ".join(sorted(map(str, found - known)))
    assert known - found == set(), f"fixed, remove from KNOWN: {sorted(known - found)}"


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """Guards the test against reading nothing: a planted import is found."""
    planted = tmp_path / "m.py"
    planted.write_text("import os\nfrom probewire.deploy.settings import Settings\n")
    assert (2, "probewire.deploy.settings") in imports(planted)


def test_the_check_sees_an_import_by_string(tmp_path: Path) -> None:
    """A "module:callable" string constant counts as an import of the module; a docstring
    that merely mentions a module does not."""
    planted = tmp_path / "m.py"
    planted.write_text(
        '"""See probewire.deploy.settings."""\n'
        'LOADER = "probewire.deploy.demo.model:load_checkpoint"\n'
    )
    assert imports(planted) == [(2, "probewire.deploy.demo.model")]
