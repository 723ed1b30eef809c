"""The reader's second line of defence: an allowlist over the engine's own parse tree.

The first line is the engine's access control (``readonly = 1`` on every reading session:
no writes, no DDL, no settings changes, and no table function that reaches the host or the
network — ``file``, ``url``, ``s3``, ``hdfs``, ``remote``, ``executable``, ``dictionary``
and the rest are refused by the engine). Two things pass ``readonly = 1`` because the
engine does not count them as reaching out: ``INTO OUTFILE`` (written by the embedded
engine's client side) and the scalar function ``file()``; and ``KILL QUERY`` is allowed
in read-only mode. So before a query runs, the reader asks the engine for its parse tree
(``EXPLAIN AST`` of the engine's own single-statement rendering, ``formatQuerySingleLine``)
and ``refusal`` checks that tree — never the query's text:

- the statement is a SELECT (with UNION / INTERSECT / EXCEPT, CTEs, subqueries) or one of
  the read-only ``SHOW`` / ``DESCRIBE`` / ``EXISTS`` forms; nothing else (KILL, SYSTEM,
  INSERT, SET, ...);
- no ``INTO OUTFILE`` (the out-file literal is a direct child of the top SELECT);
- a table function in ``FROM`` is one that computes rows from its arguments only;
- no scalar function that reads the host (``file``).

Pure functions over the ``EXPLAIN AST`` text; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["refusal"]

# EXPLAIN AST names of the statements a reader answers
_READ_STATEMENTS = frozenset(
    {
        "SelectWithUnionQuery",
        "SelectIntersectExceptQuery",
        "ShowTables",
        "ShowColumns",
        "DescribeQuery",
        "ExistsTableQuery",
        "ExistsDatabaseQuery",
        "ExistsViewQuery",
        "ShowCreateTableQuery",
        "ShowCreateViewQuery",
        "ShowCreateDatabaseQuery",
    }
)
# table functions that compute rows from their arguments alone (no host, network or store)
_TABLE_FUNCTIONS = frozenset(
    {
        "numbers",
        "numbers_mt",
        "zeros",
        "zeros_mt",
        "generate_series",
        "generateseries",
        "values",
        "view",
        "null",
    }
)
# scalar functions that read the host although the engine allows them in read-only mode
_HOST_FUNCTIONS = frozenset({"file"})


def _nodes(ast: str) -> list[tuple[int, str]]:
    """``(depth, label)`` per line of ``EXPLAIN AST`` output (one space per level)."""
    return [
        (len(line) - len(line.lstrip(" ")), line.strip())
        for line in ast.splitlines()
        if line.strip()
    ]


def _with_parents(nodes: list[tuple[int, str]]) -> Iterator[tuple[str, str]]:
    """``(label, parent label)`` for every node."""
    stack: list[tuple[int, str]] = []
    for depth, label in nodes:
        while stack and stack[-1][0] >= depth:
            stack.pop()
        yield label, stack[-1][1] if stack else ""
        stack.append((depth, label))


def _function(label: str) -> str | None:
    """The lower-cased name of a ``Function NAME ...`` node, else None."""
    parts = label.split()
    return parts[1].lower() if len(parts) > 1 and parts[0] == "Function" else None


def refusal(ast: str) -> str | None:
    """Why the statement whose ``EXPLAIN AST`` text is ``ast`` is refused, or None."""
    nodes = _nodes(ast)
    if not nodes:
        return "an empty statement"
    root = nodes[0][1].split()[0]
    if root not in _READ_STATEMENTS:
        return f"{root} statements (the reader answers SELECT, SHOW, DESCRIBE and EXISTS)"
    top_depth = nodes[0][0]
    for label, parent in _with_parents(nodes):
        name = _function(label)
        if parent.startswith("TableExpression") and name and name not in _TABLE_FUNCTIONS:
            return f"the table function {name}() (the reader reads the store's tables only)"
        if name in _HOST_FUNCTIONS:
            return f"the function {name}() (it reads the host's files)"
    children = [label for depth, label in nodes if depth == top_depth + 1]
    if root == "SelectWithUnionQuery" and any(c.startswith("Literal") for c in children):
        return "INTO OUTFILE (the reader writes no files)"
    return None
