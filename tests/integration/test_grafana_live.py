"""Every provisioned Grafana dashboard against a live store, through the HTTP read path
the Grafana ClickHouse data source uses (protocol HTTP, Native format, gzip asked for).

Two simulated runs go into the test's chdb store; the store's read-only endpoint
(``sinks.readserver.ReadServer``) serves it, and clickhouse-connect queries it over HTTP.
Each dashboard's variables are resolved by running their queries there; then every panel
and annotation query, with Grafana's variables and macros substituted, must return its
columns and rows. A third, 200,000-step run with a one-step spike in every first-screen
series checks the downsampling: every panel returns at most 2,000 rows, and each series'
max and min over them are those of the whole run. No Grafana server runs here: the rendering follows Grafana's rules
(``tests/grafana_sql.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import clickhouse_connect
import pytest
from grafana_sql import DASHBOARDS, load, panels, queries, render, resolve

from probewire.deploy.demo.faults import LayerExplosion, Straggler
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run
from probewire.instrument.catalog import CATALOG
from probewire.sinks import ClickHouseSink
from probewire.sinks.readserver import ReadServer
from probewire.stream.series import STEP_SERIES

pytestmark = pytest.mark.integration

RUN_A, RUN_B = "grafana-a", "grafana-b"
STRAGGLER = 2
DB = "pw_grafana_live"
BY_UID = {load(p)["uid"]: p for p in DASHBOARDS}


@pytest.fixture(scope="module")
def live(store_url: str, ch_client):
    """(HTTP client of the live reader, database, the two simulated runs)."""
    if not store_url.startswith("chdb:///"):
        pytest.skip("the live reader serves an embedded (chdb) store")
    db = DB
    ch_client.command(f"DROP DATABASE IF EXISTS {db}")
    sink = ClickHouseSink(ch_client, db)
    sink.migrate()
    runs = {
        RUN_A: simulated_run(
            RUN_A,
            steps=150,
            faults=(
                LayerExplosion(layer=1, step=130, scale=50.0),
                Straggler(rank=STRAGGLER, step=100, factor=3.0, duration=0),
            ),
        ),
        RUN_B: simulated_run(RUN_B, steps=120, seed=1),
    }
    for i, run in enumerate(runs.values()):  # the simulator has no optimizer: give it a schedule
        for row in run.tables["step_metrics"]:
            row["lr"] = 3e-4 * (1 + i) * min(1.0, (row["step"] + 1) / 20)
        write_simulated_run(sink, run)
    sink.write(  # RUN_A logged one metric of its own (Monitor.log) every 10 steps
        "user_metrics",
        [
            {
                "run_id": RUN_A,
                "step": step,
                "name": "val_acc",
                "value": step / 200,
                "reduction": "mean",
            }
            for step in range(0, 150, 10)
        ],
    )
    server = ReadServer(Path(store_url[len("chdb://") :]))
    server.start()
    # what the data source's driver does: HTTP, Native format, gzip accepted
    http = clickhouse_connect.get_client(
        host="127.0.0.1", port=server.port, database=db, compress="gzip"
    )
    try:
        yield http, db, runs
    finally:
        server.close()
        ch_client.command(f"DROP DATABASE IF EXISTS {db}")


def _run(http):
    return lambda sql: http.query(sql).result_rows


def _all(dashboard: dict, http, choose: dict[str, str]):
    """(selected, listed, {where: result}) of one dashboard over HTTP."""
    selected, listed = resolve(dashboard, _run(http), choose={"database": DB, **choose})
    return (
        selected,
        listed,
        {where: http.query(render(sql, selected)) for where, sql in queries(dashboard)},
    )


def _check_panels(dashboard: dict, results: dict) -> None:
    """Every panel's series (target A) returns rows; the anomaly markers (further targets)
    return (tokens, anomaly) rows only where a detector fired. Trend panels carry their x
    field, ascending within each series, the series column they split by, and values."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            where = f"panel {panel['id']} {target['refId']}"
            result = results[where]
            cols = result.column_names
            if target["refId"] != "A":
                assert not result.row_count or cols == ("tokens", "anomaly"), (where, cols)
                continue
            assert result.row_count > 0, (dashboard["uid"], panel["title"], where)
            if panel["type"] != "trend":
                continue
            assert panel["options"]["xField"] in cols, (panel["title"], cols)
            split = [
                t["options"]["fields"][0]
                for t in panel["transformations"]
                if t["id"] == "partitionByValues"
            ]
            assert all(f in cols for f in split), (panel["title"], cols)
            x, key = cols.index("tokens"), [cols.index(f) for f in split]
            series: dict = {}
            for row in result.result_rows:
                series.setdefault(tuple(row[i] for i in key), []).append(row[x])
            assert all(xs == sorted(xs) for xs in series.values()), panel["title"]
            values = [c for c in cols if c != "tokens" and c not in split]
            assert values and any(
                row[cols.index(c)] is not None for row in result.result_rows for c in values
            ), panel["title"]


def test_first_screen_variables_list_ranks_sources_layers_and_every_panel_answers(live):
    http, _, _ = live
    dashboard = load(BY_UID["probewire-first-screen"])
    selected, listed, results = _all(dashboard, http, {"run_id": RUN_A})
    assert set(listed["run_id"]) == {RUN_A, RUN_B}
    assert listed["rank"] == ["0", "1", "2", "3"]
    assert listed["source"] == ["code", "math", "web"]
    assert listed["tensor_kind"] == ["bwd", "grad"]
    assert "output" in listed["layer"] and "layers.1.mlp" in listed["layer"]
    assert listed["expert_layer"] == ["0", "1", "2", "3"]
    assert listed["user_metric"] == ["val_acc"]
    assert not {v for vs in listed.values() for v in vs} & set(CATALOG)  # no raw components
    _check_panels(dashboard, results)
    assert results["annotation Anomalies"].row_count >= 2
    # the straggler's own time stands above every other rank's at the latest step
    table = results["panel 12 A"]
    first = dict(zip(table.column_names, table.result_rows[0]))
    assert first["rank"] == STRAGGLER and first["own_time_ratio"] > 1.5
    assert table.row_count == 4
    # the user metric's panel: the stored values at their steps' tokens
    mine = results["panel 19 A"]
    tokens = dict(
        http.query(
            f"SELECT step, tokens FROM step_metrics FINAL WHERE run_id = '{RUN_A}'"
        ).result_rows
    )
    assert [tuple(r) for r in mine.result_rows] == [
        (tokens[step], "val_acc", step / 200) for step in range(0, 150, 10)
    ]


def test_one_rank_dashboard_reads_the_rank_against_the_float64_reference(live):
    http, _, runs = live
    dashboard = load(BY_UID["probewire-rank"])
    last = max(runs[RUN_A].reference)
    worst = runs[RUN_A].reference[last][2]
    selected, listed, results = _all(dashboard, http, {"run_id": RUN_A, "rank": str(worst)})
    assert listed["rank"] == ["0", "1", "2", "3"]
    _check_panels(dashboard, results)
    loss = results["panel 3 A"]
    rows = [dict(zip(loss.column_names, r)) for r in loss.result_rows]
    tokens = {r["tokens"]: r for r in rows}
    step_tokens = http.query(
        f"SELECT tokens FROM step_metrics FINAL WHERE run_id = '{RUN_A}' AND step = {last}"
    ).result_rows[0][0]
    L, L_max, _ = runs[RUN_A].reference[last]
    assert tokens[step_tokens]["rank_loss"] == pytest.approx(L_max, rel=1e-12)
    assert tokens[step_tokens]["run_L"] == pytest.approx(L, rel=1e-12)
    # the straggler's own time against the job's step time, and its alert
    _, _, straggler = _all(dashboard, http, {"run_id": RUN_A, "rank": str(STRAGGLER)})
    times = straggler["panel 1 A"]
    late = [dict(zip(times.column_names, r)) for r in times.result_rows][-1]
    assert late["rank_own_time_s"] > 0.8 * late["job_step_time_s"]
    assert straggler["panel 7 A"].row_count >= 1


def test_runs_against_each_other_overlay_every_chosen_run_on_tokens(live):
    http, _, _ = live
    dashboard = load(BY_UID["probewire-compare"])
    [runs] = [v for v in dashboard["templating"]["list"] if v["name"] == "runs"]
    assert runs["multi"] and "runs FINAL" in runs["query"]["rawSql"]  # N runs, from the table
    selected, listed, results = _all(dashboard, http, {"runs": [RUN_A, RUN_B]})
    assert set(listed["runs"]) >= {RUN_A, RUN_B}
    assert listed["source"] == ["code", "math", "web"]
    _check_panels(dashboard, results)
    for panel in panels(dashboard):
        if panel["type"] == "trend":
            result = results[f"panel {panel['id']} A"]
            split = panel["transformations"][0]["options"]["fields"][0]
            names = {row[result.column_names.index(split)] for row in result.result_rows}
            assert any(RUN_A in n for n in names) and any(RUN_B in n for n in names), panel["title"]
    config = results["panel 10 A"]
    assert [r[0] for r in config.result_rows] == sorted([RUN_A, RUN_B])


LONG, LONG_STEPS, SPIKE = "grafana-long", 200_000, 123_457
DOWNSAMPLED = "-- downsampled:"


@pytest.fixture(scope="module")
def long_run(live, ch_client):
    """A 200,000-step run in step_metrics: every first-screen Float64 series a smooth curve
    with one spike up at step ``SPIKE`` and one dip down at ``SPIKE + 1000``."""
    http, db, _ = live
    columns = [s.name for s in STEP_SERIES if s.first_screen and s.sql == "Nullable(Float64)"]
    curve = ", ".join(
        f"(2 + sin(number / {1000 + 37 * i})) * if(number = {SPIKE}, 50, 1)"
        f" * if(number = {SPIKE + 1000}, 0.01, 1)"
        for i in range(len(columns))
    )
    ch_client.command(
        f"INSERT INTO {db}.step_metrics (run_id, step, tokens, {', '.join(columns)}) "
        f"SELECT '{LONG}', number, (number + 1) * 4096, {curve} FROM numbers({LONG_STEPS})"
    )
    ch_client.command(  # and a user metric on every step, with its own spike
        f"INSERT INTO {db}.user_metrics (run_id, step, name, value, reduction) "
        f"SELECT '{LONG}', number, 'val_acc', cos(number / 777) + if(number = {SPIKE + 7}, 9, 0), "
        f"'mean' FROM numbers({LONG_STEPS})"
    )
    ch_client.command(
        f"INSERT INTO {db}.runs (run_id, world_size, first_step, last_step) "
        f"VALUES ('{LONG}', 1, 0, {LONG_STEPS - 1})"
    )
    return http, columns


def _inner(sql: str) -> str:
    """The query a downsampled panel query wraps (``WITH src AS (...)``)."""
    return sql.split("WITH src AS (\n", 1)[1].split("\n),\n(SELECT greatest", 1)[0]


def test_every_panel_downsamples_a_long_run_and_keeps_its_spike(long_run):
    """Each trend panel's series query: at most 2,000 rows for 200,000 steps, and for each
    series, the max and min over those rows are the whole run's (the spike and the dip)."""
    http, columns = long_run
    checked = 0
    for uid, choose, then in (
        # the drill-down variables (layers, kinds) listed for RUN_A, the panels on LONG
        ("probewire-first-screen", {"run_id": RUN_A}, {"run_id": [LONG]}),
        ("probewire-compare", {"runs": [LONG, RUN_A]}, {}),
    ):
        dashboard = load(BY_UID[uid])
        selected, _ = resolve(dashboard, _run(http), choose={"database": DB, **choose})
        selected.update(then)
        for panel in panels(dashboard):
            if panel["type"] not in ("trend", "timeseries"):
                continue
            [sql] = [t["rawSql"] for t in panel["targets"] if t["refId"] == "A"]
            assert sql.startswith(DOWNSAMPLED), (uid, panel["title"])
            got = http.query(render(sql, selected))
            assert got.row_count <= 2_000, (uid, panel["title"], got.row_count)
            if panel["type"] != "trend" or not got.row_count:
                continue
            split = [
                f
                for t in panel["transformations"]
                if t["id"] == "partitionByValues"
                for f in t["options"]["fields"]
            ]
            names = got.column_names
            values = [c for c in names if c != "tokens" and c not in split]
            keys = ", ".join(split) or "1"
            extremes = ", ".join(f"max({c}), min({c})" for c in values)
            full = http.query(
                f"SELECT {keys}, {extremes} FROM ({render(_inner(sql), selected)}) "
                f"GROUP BY {keys} ORDER BY {keys}"
            ).result_rows
            for row in full:
                key = row[: len(split)]
                mine = [
                    r for r in got.result_rows if tuple(r[names.index(f)] for f in split) == key
                ]
                for i, c in enumerate(values):
                    kept = [r[names.index(c)] for r in mine if r[names.index(c)] is not None]
                    at = max(len(split), 1) + 2 * i  # after the key columns (or the 1)
                    top, bottom = row[at], row[at + 1]
                    if top is None:
                        continue
                    assert max(kept) == top and min(kept) == bottom, (panel["title"], key, c)
            checked += 1
    assert checked >= 13  # the first screen's and the compare dashboard's series panels
    # the spike is the stored value of a first-screen series at step SPIKE
    loss = http.query(f"SELECT max(loss) FROM first_screen WHERE run_id = '{LONG}'").result_rows[0][
        0
    ]
    assert loss == pytest.approx((2 + math.sin(SPIKE / 1000)) * 50) and "loss" in columns
