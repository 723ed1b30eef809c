"""The Grafana dashboards: the first screen's nine P0 panels, the one-rank and run-vs-run
dashboards, their variables, and their SQL on a migrated store (rendered as Grafana renders
it: ``tests/grafana_sql.py``; over the live HTTP reader: tests/integration/test_grafana_live.py)."""

from __future__ import annotations

import json
import re

import pytest
import yaml
from grafana_sql import CHART_DASHBOARDS, DASHBOARD_DIR, DASHBOARDS, load, queries, render, resolve
from grafana_sql import panels as _panels

from probewire.deploy.demo.faults import LayerExplosion
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run
from probewire.instrument.catalog import CATALOG, Comm, Loss, Memory, Output, System
from probewire.sinks import ClickHouseSink

DASHBOARD = DASHBOARD_DIR / "probewire-first-screen.json"
PROVISIONING = DASHBOARD_DIR / "provisioning"
RUN = "grafana-run"

P0_TITLES = (
    "Loss: mean L and worst rank L_max",
    "Loss by source",
    "Gradient norm G2",
    "Co-spikes",
    "Step time and throughput",
    "Peak memory",
    "Expert balance: MaxVio",
    "Output |x|max",
    "Held-out bits per byte",
)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return load(DASHBOARD)


def _all_panels(dashboard: dict) -> list[dict]:
    return list(_panels(dashboard))


def _first_screen(dashboard: dict) -> list[dict]:
    """Panels between the first row and the next one."""
    top = dashboard["panels"]
    assert top[0]["type"] == "row" and "First screen" in top[0]["title"]
    end = next(i for i, p in enumerate(top[1:], 1) if p["type"] == "row")
    return top[1:end]


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
    sql = {
        a["name"]: a["target"]["rawSql"] for a in dashboard["annotations"]["list"] if "target" in a
    }
    assert "${database}.anomalies" in sql["Anomalies"]
    assert "${database}.alerts" in sql["Alerts"]
    assert all("AS time" in s and "AS title" in s for s in sql.values())


def test_run_id_is_a_template_variable_used_by_every_panel(dashboard) -> None:
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "database", "run_id", "rank", "source", "layer"} <= names
    for where, sql in queries(dashboard):
        assert "${run_id:singlequote}" in sql, where


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_multi_value_variables_are_always_formatted_and_components_never_listed(path) -> None:
    """A multi-value variable renders as a list only with a format (singlequote, csv); no
    variable lists a metric's components, and every component a query names is one the
    catalog defines."""
    board = load(path)
    multi = {v["name"] for v in board["templating"]["list"] if v.get("multi")}
    sqls = [sql for _, sql in queries(board)] + [
        v["query"]["rawSql"]
        for v in board["templating"]["list"]
        if isinstance(v.get("query"), dict)
    ]
    for sql in sqls:
        for name, fmt in re.findall(r"\$\{(\w+)(?::(\w+))?\}", sql):
            assert name not in multi or fmt in ("singlequote", "csv"), (path.name, name, sql)
        components = re.findall(r"'([a-z_]+\.[a-z_0-9]+)'", sql)
        assert set(components) <= set(CATALOG), (path.name, components)
    for var in board["templating"]["list"]:
        assert "DISTINCT metric" not in var.get("definition", ""), var["name"]


def test_the_rank_dashboard_forms_its_series_from_catalog_components() -> None:
    sql = " ".join(s for _, s in queries(load(DASHBOARD_DIR / "probewire-rank.json")))
    assert set(re.findall(r"'([a-z_]+\.[a-z_0-9]+)'", sql)) == {
        System.STEP_TIME,
        Comm.WAIT,
        Loss.SUM,
        Loss.TOKENS,
        Memory.PEAK_ALLOCATED,
        Memory.PEAK_RSS,
        Output.LOGITS_ABS_MAX,
    }


def test_every_dashboard_has_its_own_uid_and_links_to_the_others() -> None:
    boards = [load(p) for p in DASHBOARDS]
    assert {b["uid"] for b in boards} == {
        "probewire-first-screen",
        "probewire-rank",
        "probewire-compare",
    }
    for board in boards:
        assert "probewire" in board["tags"]
        assert any(
            link["type"] == "dashboards" and link["tags"] == ["probewire"]
            for link in board["links"]
        )


def test_every_query_runs_on_a_migrated_store_and_p0_panels_return_rows(
    dashboard, ch_client, ch_database
) -> None:
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    write_simulated_run(
        sink, simulated_run(RUN, steps=150, faults=(LayerExplosion(layer=1, step=130, scale=50.0),))
    )
    selected, listed = resolve(
        dashboard, lambda sql: ch_client.query(sql).result_rows, choose={"database": ch_database}
    )
    results = {where: ch_client.query(render(sql, selected)) for where, sql in queries(dashboard)}
    for panel in _first_screen(dashboard):
        main = results[f"panel {panel['id']} A"]
        assert "tokens" in main.column_names and main.row_count > 0, panel["title"]
        tokens = [row[main.column_names.index("tokens")] for row in main.result_rows]
        if "partitionByValues" not in json.dumps(panel["transformations"]):
            assert tokens == sorted(tokens), panel["title"]  # trend panels need ascending x
    marked = {
        p["title"].split(":")[0]: results[f"panel {p['id']} B"].row_count
        for p in _first_screen(dashboard)
        if len(p["targets"]) > 1
    }
    assert marked["Gradient norm G2 and clip rate"] >= 1
    assert marked["Co-spikes (cumulative count)"] == 1
    assert results["annotation Anomalies"].row_count >= 2
    assert listed["run_id"] == [RUN]
    assert listed["rank"] == ["0", "1", "2", "3"] and listed["tensor_kind"] == ["bwd", "grad"]
    layer_walk = results["panel 13 A"]
    first = dict(zip(layer_walk.column_names, layer_walk.result_rows[0]))
    assert first["tensor"] == "output"  # the walk starts at the output


def test_the_chart_ships_the_same_dashboards() -> None:
    assert sorted(p.name for p in CHART_DASHBOARDS.glob("*.json")) == [p.name for p in DASHBOARDS]
    for path in DASHBOARDS:
        assert (CHART_DASHBOARDS / path.name).read_bytes() == path.read_bytes()


def test_provisioning_points_grafana_at_the_reader_over_http_and_at_these_dashboards() -> None:
    [source] = yaml.safe_load((PROVISIONING / "datasources" / "probewire.yaml").read_text())[
        "datasources"
    ]
    assert source["type"] == "grafana-clickhouse-datasource"
    assert source["jsonData"]["protocol"] == "http"
    assert source["jsonData"]["port"] == "${PROBEWIRE_SQL_PORT}"
    assert source["jsonData"]["host"] == "127.0.0.1"
    [provider] = yaml.safe_load((PROVISIONING / "dashboards" / "probewire.yaml").read_text())[
        "providers"
    ]
    assert provider["type"] == "file" and provider["options"]["path"] == "${PROBEWIRE_DASHBOARDS}"
    for path in DASHBOARDS:  # the data source variable lists the provisioned source's type
        [var] = [v for v in load(path)["templating"]["list"] if v["type"] == "datasource"]
        assert var["query"] == source["type"]


def test_every_charted_first_screen_series_of_the_registry_has_a_panel(dashboard) -> None:
    """The registry (``stream.series``) is what a Grafana panel may name: each first-screen
    column charted on one of the nine panels is read by some first-screen panel (a new row
    there with no Grafana panel fails here); a panel naming a column the registry lacks
    fails on the store in ``test_every_query_runs_on_a_migrated_store_...``, whose tables
    the registry builds."""
    from probewire.stream.series import CHARTS, STEP_SERIES

    on_panels = {c.key for c in CHARTS if c.panel is not None}
    sql = " ".join(t["rawSql"] for p in _first_screen(dashboard) for t in p["targets"])
    words = set(re.findall(r"[a-z_][a-z0-9_]*", sql))
    charted = [s.name for s in STEP_SERIES if s.first_screen and s.chart in on_panels]
    assert charted and [name for name in charted if name not in words] == []


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_settings_and_counts_read_as_their_values_on_an_axis_from_0(path) -> None:
    """A panel of the learning rate (a constant 0.003 must not sit on an axis around it)
    or of a cumulative count has its y axis from 0; a count has whole-number ticks."""
    found = 0
    for panel in _panels(load(path)):
        sql = " ".join(t["rawSql"] for t in panel.get("targets", []) if t["refId"] == "A")
        if re.search(r"\blr\b|cospike_count", sql):
            defaults = panel["fieldConfig"]["defaults"]
            assert defaults.get("min") == 0, (path.name, panel["title"])
            if "cospike_count" in sql:
                assert defaults.get("decimals") == 0, (path.name, panel["title"])
            found += 1
    assert found == {"probewire-rank.json": 0}.get(path.name, 1)


# A registry unit (stream.series) as a Grafana unit id: dimensionless values plain
GRAFANA_UNITS = {
    "nats/token": "suffix: nats/token",
    "L2 norm": "none",
    "count": "none",
    "ratio": "none",
    "lr": "none",
    "logit": "suffix: logit",
    "s": "s",
    "bytes": "bytes",
    "tokens/s": "suffix: tokens/s",
    "fraction of steps": "percentunit",
}


def _drawn_columns(sql: str) -> dict[str, str]:
    """{output column: the stored column it reads} of a series query's plain part (a
    ``name`` or ``t.name`` with or without ``AS alias``; expressions are left out)."""
    inner = sql.split("WITH src AS (\n", 1)[1]
    select = inner[len("SELECT ") : inner.index("FROM")]
    out = {}
    for item in re.split(r",\s*(?![^()]*\))", select):
        m = re.fullmatch(r"\s*(?:\w+\.)?(\w+)(?:\s+AS\s+(\w+))?\s*", item)
        if m:
            out[m.group(2) or m.group(1)] = m.group(1)
    return out


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panel_units_are_the_registrys(path) -> None:
    """A series panel's unit is its first value's registry unit (G2 has none: a plain
    number, never "short" SI suffixes or the catalog's "1"; a loss reads nats/token), and a
    right-axis override of a stored column carries that column's unit."""
    from probewire.stream.series import STEP_SERIES

    units = {s.name: s.unit for s in STEP_SERIES}
    checked = 0
    for panel in _panels(load(path)):
        if panel["type"] != "trend":
            continue
        [sql] = [t["rawSql"] for t in panel["targets"] if t["refId"] == "A"]
        drawn = _drawn_columns(sql)
        split = {
            f
            for t in panel["transformations"]
            if t["id"] == "partitionByValues"
            for f in t["options"]["fields"]
        }
        values = [c for c in drawn if c != "tokens" and c not in split]
        if values and drawn[values[0]] in units:
            want = GRAFANA_UNITS[units[drawn[values[0]]]]
            assert panel["fieldConfig"]["defaults"]["unit"] == want, (path.name, panel["title"])
            checked += 1
        for override in panel["fieldConfig"].get("overrides", []):
            column = drawn.get(override["matcher"].get("options"))
            for prop in override["properties"]:
                if prop["id"] == "unit" and column in units and column != "tokens":
                    assert prop["value"] == GRAFANA_UNITS[units[column]], (path.name, column)
    assert checked >= 5, path.name
