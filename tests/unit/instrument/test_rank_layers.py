"""The rank side reads in one direction: each module imports only modules below it,
monitor → step → probes → state → collect (userlog) → wire → catalog, with the attach-time tables
(config, registry, discover) and the pure math (scan, batchscan) beside that chain. No
cycle, and no TYPE_CHECKING import that would hide one."""

from __future__ import annotations

import ast
from pathlib import Path

INSTRUMENT = Path(__file__).resolve().parents[3] / "instrument"

# layer of each module: a module may import only modules of a strictly lower layer
# (probe homes may import the shared helpers in probes/ and each other, without a cycle)
LAYERS = {
    "catalog": 0,
    "scan": 0,
    "control": 0,
    "spool": 0,
    "kafkalog": 0,
    "structure_config": 0,
    "wire": 1,
    "config": 1,
    "batchscan": 1,
    "collect": 2,
    "userlog": 2,
    "parallel": 2,
    "export": 2,
    "testing": 2,
    "state": 3,
    "registry": 3,
    "lifecycle": 3,
    "replay": 3,
    "discover": 4,
    "probes": 5,
    "step": 6,
    "monitor": 7,
    "integrations": 8,
    "__init__": 8,
}


def module_name(path: Path) -> str:
    rel = path.relative_to(INSTRUMENT).with_suffix("")
    return ".".join(rel.parts)


def layer(name: str) -> int:
    return LAYERS[name.split(".")[0]]


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported instrument module, line, under TYPE_CHECKING) of one file."""
    tree = ast.parse(path.read_text())
    package = module_name(path).split(".")[:-1]
    guarded = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test)
        for n in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] if node.level > 1 else package
                target = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            elif (node.module or "").startswith("probewire.instrument."):
                target = node.module.removeprefix("probewire.instrument.")
            else:
                continue
            for alias in node.names:
                full = f"{target}.{alias.name}" if target else alias.name
                name = full if (INSTRUMENT / (full.replace(".", "/") + ".py")).exists() else target
                if name:
                    found.append((name, node.lineno, id(node) in guarded))
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in INSTRUMENT.rglob("*.py"):
        name = module_name(path)
        if name.endswith("__init__") and name != "__init__":
            continue
        edges[name] = {target for target, _, _ in imports(path) if target != name}
    return edges


def test_every_import_goes_down_a_layer():
    upward = []
    for path in INSTRUMENT.rglob("*.py"):
        name = module_name(path)
        for target, line, guarded in imports(path):
            if name == "__init__":
                continue  # the package face re-exports everything, lazily
            assert not guarded, f"{name}:{line}: a TYPE_CHECKING import of {target}"
            same_probes = name.startswith("probes.") and target.startswith("probes")
            if not same_probes and layer(target) >= layer(name):
                upward.append(f"{name}:{line} imports {target}")
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    edges = graph()
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in edges.get(node, ()):
            assert state.get(nxt) != 1, "cycle: " + " -> ".join([*trail, node, nxt])
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in edges:
        if node not in state:
            visit(node, [])


def test_no_module_outside_the_monitor_touches_its_private_members():
    for path in INSTRUMENT.rglob("*.py"):
        if path.name == "monitor.py":
            continue
        text = path.read_text()
        assert "monitor._" not in text and "_m._" not in text, path
