"""The SQL of the provisioned Grafana dashboards, rendered the way Grafana renders it.

Grafana substitutes template variables (``${name}``, ``${name:singlequote}``,
``${name:csv}``) and the ClickHouse data source then expands its macros
(``$__timeFilter(column)``) before a query reaches the server. ``resolve`` runs the
dashboard's variable queries in their order, each rendered with the values chosen so far
(a multi-value "All" variable selects every value, any other the first one unless told),
and ``render`` substitutes those values into a panel's SQL.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD_DIR = ROOT / "deploy" / "grafana"
CHART_DASHBOARDS = ROOT / "helm" / "probewire" / "files" / "dashboards"
DASHBOARDS = sorted(DASHBOARD_DIR.glob("*.json"))

_VAR = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(\w+)")
_TIME_FILTER = re.compile(r"\$__timeFilter\(([^)]+)\)")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def variables(dashboard: dict) -> list[dict]:
    return dashboard["templating"]["list"]


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, SQL) of every panel target and annotation (variables: ``resolve``)."""
    found = [
        (f"panel {p['id']} {t['refId']}", t["rawSql"])
        for p in panels(dashboard)
        for t in p.get("targets", [])
    ]
    found += [
        (f"annotation {a['name']}", a["target"]["rawSql"])
        for a in dashboard["annotations"]["list"]
        if "target" in a
    ]
    return found


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def render(sql: str, values: dict[str, list[str]], *, span_s: float = 7 * 86400) -> str:
    """``sql`` with Grafana's variables and the data source's time macro substituted."""
    now = int(time.time())

    def one(match: re.Match) -> str:
        name, fmt = match.group(1) or match.group(3), match.group(2)
        if name.startswith("__"):
            return match.group(0)
        chosen = values[name]  # a KeyError names a variable the dashboard does not define
        if fmt == "singlequote":
            return ",".join(_quote(v) for v in chosen)
        if fmt == "csv":
            return ",".join(chosen)
        if fmt not in (None, "raw"):
            raise ValueError(f"format {fmt!r} of ${name} is not rendered here")
        if len(chosen) != 1:
            raise ValueError(f"${name} has {len(chosen)} values: give it a format")
        return chosen[0]

    sql = _TIME_FILTER.sub(
        lambda m: (
            f"{m.group(1)} >= toDateTime({now - int(span_s)}) AND "
            f"{m.group(1)} <= toDateTime({now + 3600})"
        ),
        sql,
    )
    sql = _VAR.sub(one, sql)
    assert "$" not in sql, sql
    return sql


def resolve(
    dashboard: dict,
    run: Callable[[str], list[tuple]],
    *,
    choose: dict[str, str | list[str]] | None = None,
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(selected values, all listed values) per variable; ``run(sql)`` returns rows.
    ``choose`` picks one listed value of a variable (a textbox's text), or several of a
    multi-value variable, instead of the default."""
    choose = choose or {}
    selected: dict[str, list[str]] = {}
    listed: dict[str, list[str]] = {}
    for var in variables(dashboard):
        name = var["name"]
        if var["type"] == "datasource":
            continue
        if var["type"] == "textbox":
            text = choose.get(name, var["query"])
            assert isinstance(text, str), (name, text)
            listed[name] = selected[name] = [text]
            continue
        assert var["type"] == "query", (name, var["type"])
        listed[name] = [str(row[0]) for row in run(render(var["query"]["rawSql"], selected))]
        if name in choose:
            chosen = choose[name]
            picked = [chosen] if isinstance(chosen, str) else list(chosen)
            assert set(picked) <= set(listed[name]), (name, listed[name])
            assert len(picked) == 1 or var.get("multi"), (name, picked)
            selected[name] = picked
        elif var.get("multi") and var.get("includeAll"):
            selected[name] = listed[name]
        else:
            selected[name] = listed[name][:1]
    return selected, listed
