"""The Grafana dashboard: nine P0 panels whose SQL runs on a migrated store."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from probewire.sinks import ClickHouseSink
from probewire.deploy.demo.faults import LayerExplosion
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "probewire-first-screen.json"
CHART_COPY = ROOT / "helm" / "probewire" / "files" / "dashboards" / "probewire-first-screen.json"
RUN = "grafana-run"

P0_TITLES = ("Loss: mean L and worst rank L_max", "Loss by source", "Gradient norm G2",
             "Co-spikes", "Step time and throughput", "Peak memory", "Expert balance: MaxVio",
             "Output |x|max", "Held-out bits per byte")


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _first_screen(dashboard: dict) -> list[dict]:
    """Panels between the first row and the next one."""
    top = dashboard["panels"]
    assert top[0]["type"] == "row" and "First screen" in top[0]["title"]
    end = next(i for i, p in enumerate(top[1:], 1) if p["type"] == "row")
    return top[1:end]


def _concrete(sql: str, db: str) -> str:
    """Grafana variables and plugin macros replaced by what they expand to."""
    sql = (sql.replace("${database}", db).replace("${run_id:singlequote}", f"'{RUN}'")
              .replace("${rank_metric:singlequote}", "'step_time_s'")
              .replace("${tensor_kind:singlequote}", "'bwd'"))
    sql = re.sub(r"\$__timeFilter\(([^)]+)\)",
                 r"(\1 >= toDateTime64('2000-01-01 00:00:00', 3) AND "
                 r"\1 <= toDateTime64('2100-01-01 00:00:00', 3))", sql)
    assert "$" not in sql, sql
    return sql


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, SQL) of every panel target, annotation and variable query."""
    found = [(f"panel {p['id']} {t['refId']}", t["rawSql"])
             for p in _all_panels(dashboard) for t in p.get("targets", [])]
    found += [(f"annotation {a['name']}", a["target"]["rawSql"])
              for a in dashboard["annotations"]["list"] if "target" in a]
    found += [(f"variable {v['name']}", v["query"]["rawSql"])
              for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    return found


def test_the_first_row_holds_the_nine_p0_panels_against_tokens(dashboard) -> None:
    panels = _first_screen(dashboard)
    assert len(panels) == 9
    for panel, title in zip(panels, P0_TITLES):
        assert panel["title"].startswith(title)
        assert panel["type"] == "trend" and panel["options"]["xField"] == "tokens"
        assert panel["datasource"]["type"] == "grafana-clickhouse-datasource"
        assert all("tokens" in t["rawSql"] for t in panel["targets"])
    assert len({(p["gridPos"]["x"], p["gridPos"]["y"]) for p in panels}) == 9


def test_the_drill_down_row_covers_ranks_layers_and_experts(dashboard) -> None:
    [drill] = [p for p in dashboard["panels"] if p["type"] == "row" and "Drill-down" in p["title"]]
    sql = " ".join(t["rawSql"] for p in drill["panels"] for t in p["targets"])
    for table in ("rank_metrics", "tensor_view", "expert_balance", "expert_stats", "alerts"):
        assert f"${{database}}.{table}" in sql


def test_annotations_come_from_the_anomalies_and_alerts_tables(dashboard) -> None:
    sql = {a["name"]: a["target"]["rawSql"] for a in dashboard["annotations"]["list"]
           if "target" in a}
    assert "${database}.anomalies" in sql["Anomalies"]
    assert "${database}.alerts" in sql["Alerts"]
    assert all("AS time" in s and "AS title" in s for s in sql.values())


def test_run_id_is_a_template_variable_used_by_every_panel(dashboard) -> None:
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "database", "run_id"} <= names
    for where, sql in _queries(dashboard):
        if not where.startswith("variable run_id"):
            assert "${run_id:singlequote}" in sql, where


def test_every_query_runs_on_a_migrated_store_and_p0_panels_return_rows(
        dashboard, ch_client, ch_database) -> None:
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    write_simulated_run(sink, simulated_run(RUN, steps=150, faults=(
        LayerExplosion(layer=1, step=130, scale=50.0),)))
    results = {where: ch_client.query(_concrete(sql, ch_database))
               for where, sql in _queries(dashboard)}
    for panel in _first_screen(dashboard):
        main = results[f"panel {panel['id']} A"]
        assert "tokens" in main.column_names and main.row_count > 0, panel["title"]
        tokens = [row[main.column_names.index("tokens")] for row in main.result_rows]
        if "partitionByValues" not in json.dumps(panel["transformations"]):
            assert tokens == sorted(tokens), panel["title"]  # trend panels need ascending x
    marked = {p["title"].split(":")[0]: results[f"panel {p['id']} B"].row_count
              for p in _first_screen(dashboard) if len(p["targets"]) > 1}
    assert marked["Gradient norm G2 and clip rate"] >= 1
    assert marked["Co-spikes (cumulative count)"] == 1
    assert results["annotation Anomalies"].row_count >= 2
    assert results["variable run_id"].result_rows == [(RUN,)]
    layer_walk = results["panel 13 A"]
    first = dict(zip(layer_walk.column_names, layer_walk.result_rows[0]))
    assert first["tensor"] == "output"  # the walk starts at the output


def test_the_chart_ships_the_same_dashboard() -> None:
    assert CHART_COPY.read_bytes() == DASHBOARD.read_bytes()
