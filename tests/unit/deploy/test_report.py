"""The report of recorded runs: the PNG first screen (nine raw panels, anomalies marked) and
the self-contained interactive HTML page (plotly inlined, runs overlaid on one axis)."""

from __future__ import annotations

import json
import re
import uuid

import numpy as np
import pytest

from probewire.deploy.cli import main
from probewire.deploy.demo.faults import LayerExplosion
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run
from probewire.deploy.report import (
    CHARTS,
    PANELS,
    RunNotFound,
    load_first_screen,
    render_first_screen,
    write_report,
)
from probewire.sinks import ClickHouseSink

RUN, OTHER = "report-run", "report-other"


def _write_runs(client, database: str) -> None:
    sink = ClickHouseSink(client, database)
    sink.migrate()
    write_simulated_run(
        sink, simulated_run(RUN, steps=150, faults=(LayerExplosion(layer=2, step=130, scale=50.0),))
    )
    write_simulated_run(
        sink, simulated_run(OTHER, steps=100, seed=1, sources=(("web", 0.5), ("code", 0.5)))
    )


@pytest.fixture(scope="module")
def store(ch_client):
    """The two runs, written once for the tests that only read them (~2 s a store)."""
    database = f"pw_test_{uuid.uuid4().hex[:10]}"
    _write_runs(ch_client, database)
    yield ch_client, database
    ch_client.command(f"DROP DATABASE IF EXISTS {database}")


@pytest.fixture()
def own_store(ch_client, ch_database):
    """The same in a database of the test's own, for a test that changes it."""
    _write_runs(ch_client, ch_database)
    return ch_client, ch_database


def _panels(fig) -> dict:
    return {
        ax.get_label()[len("panel:") :]: ax
        for ax in fig.axes
        if ax.get_label().startswith("panel:")
    }


def _charts(html: str) -> dict[str, dict]:
    found = re.findall(
        r"<div class='pw-chart' id='chart-([a-z]+)'[^>]*>"
        r"<script type='application/json'>(.*?)</script></div>",
        html,
        re.S,
    )
    return {key: json.loads(spec.replace("<\\/", "</")) for key, spec in found}


def _raw(chart: dict, run: str) -> list[dict]:
    return [t for t in chart["data"] if t["meta"]["role"] == "raw" and t["meta"]["run"] == run]


def test_the_figure_has_nine_panels_of_raw_values_against_tokens(store) -> None:
    data = load_first_screen(*store, RUN)
    panels = _panels(render_first_screen(data))
    assert list(panels) == [p.key for p in PANELS] and len(panels) == 9
    assert [ax.get_title() for ax in panels.values()] == [p.title for p in PANELS]
    assert {ax.get_xlabel() for ax in panels.values()} == {"tokens"}
    [loss_line] = [line for line in panels["loss"].get_lines() if line.get_label() == "L"]
    np.testing.assert_array_equal(loss_line.get_xdata(), data.steps["tokens"])
    np.testing.assert_array_equal(loss_line.get_ydata(), data.steps["loss"])  # unsmoothed
    for key in ("source", "grad", "time", "memory", "experts", "output", "eval"):
        assert panels[key].get_lines(), key  # every P0 signal of the recorded run is drawn


def test_panels_with_nothing_measured_are_folded_away_with_a_note(store) -> None:
    """A dense run without evaluations or expert layers: seven panels fill the grid, and
    a note names the two folded away; no empty "not measured" tile."""
    data = load_first_screen(*store, RUN)
    data.evals = []
    for column, _ in next(p for p in PANELS if p.key == "experts").columns:
        data.steps[column] = np.full_like(data.steps[column], np.nan)
    fig = render_first_screen(data)
    panels = _panels(fig)
    assert list(panels) == [p.key for p in PANELS if p.key not in ("experts", "eval")]
    [note] = [t for t in fig.texts if t.get_gid() == "folded"]
    titles = {p.key: p.title for p in PANELS}
    assert note.get_text() == (
        f"Not measured in this run, folded away: {titles['eval']}; {titles['experts']}"
    )
    assert all(ax.get_lines() for ax in panels.values())  # every panel shown draws
    assert not [t for ax in fig.axes for t in ax.texts if "not measured" in t.get_text()]


def test_anomalies_are_marked_on_their_panels_at_their_tokens(store) -> None:
    data = load_first_screen(*store, RUN)
    panels = _panels(render_first_screen(data))
    tokens = dict(zip(data.steps["step"].astype(int), data.steps["tokens"]))

    def marks(key: str) -> list[float]:
        return [
            x
            for line in panels[key].get_lines()
            if line.get_gid() == "anomaly"
            for x in line.get_xdata()
        ]

    assert sorted(marks("grad")) == [tokens[130]]
    assert marks("cospike") == [tokens[130]]
    assert marks("loss") == [tokens[130]]
    assert marks("memory") == []
    assert all(
        any(line.get_gid() == "alert" for line in ax.get_lines()) for ax in panels.values()
    )  # the page is a line across every panel


def test_source_legend_shows_each_sources_share_of_the_runs_tokens(store) -> None:
    client, db = store
    rows = client.query(
        f"SELECT source, sum(tokens) FROM {db}.source_metrics FINAL "
        "WHERE run_id = {r:String} GROUP BY source",
        parameters={"r": OTHER},
    ).result_rows
    total = float(sum(n for _, n in rows))
    reference = {s: 100 * float(n) / total for s, n in rows}  # ≈ 50 / 50
    assert all(abs(v - 50) < 1 for v in reference.values())
    labels = {
        line.get_label()
        for line in _panels(render_first_screen(load_first_screen(client, db, OTHER)))[
            "source"
        ].get_lines()
    }
    assert labels == {f"{s} ({v:.0f}% of tokens)" for s, v in reference.items()}
    assert labels == {"code (50% of tokens)", "web (50% of tokens)"}


def test_a_run_without_cospikes_draws_its_count_from_zero(store) -> None:
    data = load_first_screen(*store, OTHER)
    assert np.nanmax(data.steps["cospike_count"]) == 0
    ax = _panels(render_first_screen(data))["cospike"]
    low, high = ax.get_ylim()
    assert low == 0 and high >= 1 and all(float(t).is_integer() for t in ax.get_yticks())


def test_the_html_page_is_self_contained_and_overlays_both_runs(store, tmp_path) -> None:
    client, db = store
    html_path, pngs = write_report(client, db, [RUN, OTHER], tmp_path / "out")
    assert html_path.name == f"{RUN}-vs-{OTHER}.html"
    assert [p.name for p in pngs] == [f"{RUN}.png", f"{OTHER}.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    html = html_path.read_text()
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=", html)  # nothing fetched
    assert "Plotly.newPlot" in html and len(html) > 3_000_000  # plotly.js is inlined
    charts = _charts(html)
    assert list(charts) == [c.key for c in CHARTS if c.key != "lr"]  # lr: not stored
    for run in (RUN, OTHER):
        data = load_first_screen(client, db, run)
        [L] = [t for t in _raw(charts["loss"], run) if t["meta"]["label"] == "L"]
        for axis in ("tokens", "flops", "step"):  # every axis of the switch, raw values
            np.testing.assert_array_equal(
                np.array(L["meta"]["x"][axis], dtype=float), data.steps[axis]
            )
        np.testing.assert_array_equal(np.array(L["y"], dtype=float), data.steps["loss"])
        for key in ("source", "grad", "time", "throughput", "memory", "eval", "cospike"):
            assert _raw(charts[key], run), (key, run)
    smooth = [t for t in charts["loss"]["data"] if t["meta"]["role"] == "smooth"]
    assert smooth and all(t["visible"] is False for t in smooth)  # smoothing starts off
    # no learning rate stored: no empty tile, folded away into the note under the charts
    assert "chart-lr" not in html and "not measured" not in html
    [folded] = re.findall(r"<p id='pw-folded'[^>]*>(.*?)</p>", html)
    assert folded == "Not measured, folded away: Learning rate"
    ranges = charts["cospike"]["layout"]["yaxis"]["range"]
    assert ranges[0] == 0
    # a cumulative count is never smoothed: no smoothed twin (the loss has one)
    assert "smooth" not in {t["meta"]["role"] for t in charts["cospike"]["data"]}
    marks = [t for t in charts["grad"]["data"] if t["meta"]["role"] == "anomaly"]
    assert [m["meta"]["run"] for m in marks] == [RUN] and marks[0]["meta"]["x"]["step"] == [130]
    assert "cospike at step 130" in html and "cospike cospike" not in html  # a page's message
    assert "nats/token</td>" in html  # anomaly values of losses carry their unit


def test_learning_rate_and_config_panels_read_the_store(own_store, tmp_path) -> None:
    client, db = own_store
    client.command(
        f"ALTER TABLE {db}.step_metrics UPDATE lr = 1e-3 * (1 + step) WHERE 1",
        settings={"mutations_sync": 2},
    )
    ClickHouseSink(client, db).write(
        "runs",
        [
            {"run_id": RUN, "world_size": 4, "config": json.dumps({"lr": 3e-3, "seed": 0})},
            {"run_id": OTHER, "world_size": 4, "config": json.dumps({"lr": 1e-3, "seed": 0})},
        ],
    )
    html = write_report(client, db, [RUN, OTHER], tmp_path)[0].read_text()
    [lr] = _raw(_charts(html)["lr"], OTHER)
    np.testing.assert_allclose(np.array(lr["y"], dtype=float), 1e-3 * (1 + np.arange(100)))
    config = re.search(r"<table class='pw-config'>(.*?)</table>", html, re.S).group(1)
    assert "<td>lr</td><td>yes</td><td>0.003</td><td>0.001</td>" in config
    assert "<td>seed</td><td></td><td>0</td><td>0</td>" in config


def test_a_constant_learning_rate_reads_as_its_value_on_an_axis_from_0(own_store, tmp_path) -> None:
    """The demo's constant lr 0.003: an axis from 0 to above 0.003 (never -1..1 around a
    flat line, where it reads as 0), never smoothed, its unit the registry's."""
    client, db = own_store
    client.command(
        f"ALTER TABLE {db}.step_metrics UPDATE lr = 0.003 WHERE 1", settings={"mutations_sync": 2}
    )
    html = write_report(client, db, [RUN], tmp_path)[0].read_text()
    chart = _charts(html)["lr"]
    axis = chart["layout"]["yaxis"]
    assert axis["range"][0] == 0 and 0.003 < axis["range"][1] < 0.005
    assert axis["title"]["text"] == next(c.unit for c in CHARTS if c.key == "lr")
    assert {t["meta"]["role"] for t in chart["data"]} == {"raw"}  # no smoothed twin


def test_user_metrics_are_drawn_as_charts_with_their_stored_values(own_store, tmp_path) -> None:
    """Each user metric is one chart (every run that logged it overlaid) whose y values are
    the stored ones at their steps, NaN a gap; the declared reduction is in its title."""
    client, db = own_store
    steps = list(range(0, 150, 10))
    acc = [0.1 + 0.005 * s for s in steps]
    acc[3] = float("nan")
    ClickHouseSink(client, db).write(
        "user_metrics",
        [
            {"run_id": RUN, "step": s, "name": "val_acc", "value": v, "reduction": "mean"}
            for s, v in zip(steps, acc)
        ]
        + [{"run_id": OTHER, "step": 5, "name": "val_acc", "value": 0.5, "reduction": "mean"}],
    )
    html = write_report(client, db, [RUN, OTHER], tmp_path)[0].read_text()
    found = re.findall(
        r"<div class='pw-chart' id='chart-user:val_acc'[^>]*>"
        r"<script type='application/json'>(.*?)</script></div>",
        html,
        re.S,
    )
    [chart] = [json.loads(spec.replace("<\\/", "</")) for spec in found]
    assert "val_acc (your metric; mean over ranks)" == chart["layout"]["title"]["text"]
    [mine] = _raw(chart, RUN)
    assert mine["meta"]["x"]["step"] == steps
    assert mine["y"] == [None if v != v else v for v in acc]
    assert _raw(chart, OTHER)[0]["y"] == [0.5]


def test_a_missing_run_is_a_clear_error_naming_the_runs_that_exist(store, tmp_path) -> None:
    with pytest.raises(RunNotFound, match=f"'nope' has no steps.*{RUN}"):
        write_report(*store, "nope", tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_cli_writes_the_report_and_explains_a_step(
    store, store_url, tmp_path, monkeypatch, capsys
) -> None:
    _, database = store
    monkeypatch.setenv("PROBEWIRE_CLICKHOUSE__DATABASE", database)
    assert (
        main(
            [
                "report",
                "--run",
                RUN,
                "--run",
                OTHER,
                "--clickhouse-url",
                store_url,
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert (tmp_path / f"{RUN}-vs-{OTHER}.html").is_file()
    assert (tmp_path / f"{RUN}.png").is_file() and (tmp_path / f"{OTHER}.png").is_file()
    assert (
        main(
            [
                "explain",
                "--run",
                RUN,
                "--step",
                "130",
                "--clickhouse-url",
                store_url,
                "--format",
                "json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"first": "cospike_count"' in out and '"signal": "cospike"' in out
    assert main(["report", "--run", "nope", "--clickhouse-url", store_url]) == 2
    assert "has no steps" in capsys.readouterr().err
    assert main(["report", "--run", RUN, "--run", RUN, "--clickhouse-url", store_url]) == 2
    assert "named twice" in capsys.readouterr().err


def test_explain_printed_into_a_pipe_keeps_every_cell_whole(
    store, store_url, monkeypatch, capsys
) -> None:
    _, database = store
    monkeypatch.setenv("PROBEWIRE_CLICKHOUSE__DATABASE", database)
    monkeypatch.delenv("COLUMNS", raising=False)  # stdout is captured: not a terminal
    assert main(["explain", "--run", RUN, "--step", "130", "--clickhouse-url", store_url]) == 0
    out = capsys.readouterr().out
    assert "…" not in out  # at rich's 80 columns: "peak_me…", "3.801e+…"
    assert (
        main(
            [
                "explain",
                "--run",
                RUN,
                "--step",
                "130",
                "--clickhouse-url",
                store_url,
                "--format",
                "json",
            ]
        )
        == 0
    )
    lines = out.splitlines()
    for finding in json.loads(capsys.readouterr().out)["findings"]:
        assert any(finding["signal"] in line for line in lines), finding["signal"]


def test_runs_lists_one_row_per_run_and_wide_rows_read_vertically(
    own_store, store_url, monkeypatch, capsys
) -> None:
    client, database = own_store
    monkeypatch.setenv("PROBEWIRE_CLICKHOUSE__DATABASE", database)
    sink = ClickHouseSink(client, database)
    for status in ("running", "finished"):  # two versions of one run's row, not merged yet
        sink.write("runs", [{"run_id": RUN, "world_size": 4, "status": status}])
    [(versions,)] = client.query(
        f"SELECT count() FROM {database}.runs WHERE run_id = {{r:String}}", parameters={"r": RUN}
    ).result_rows
    assert versions >= 2
    assert main(["runs", "--clickhouse-url", store_url]) == 0
    out = capsys.readouterr().out
    assert out.count(RUN) == 1 and out.count(OTHER) == 1 and "finished" in out
    assert (
        main(
            [
                "sql",
                "--clickhouse-url",
                store_url,
                "--format",
                "vertical",
                f"SELECT * FROM {database}.first_screen WHERE run_id = '{RUN}' "
                "ORDER BY step LIMIT 1 OFFSET 20",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    loss = load_first_screen(client, database, RUN).steps["loss"][20]
    assert all(len(line) <= 80 for line in lines) and len(lines) > 20
    assert f"loss  {loss:.6g}" in [line.strip() for line in lines]  # name, value beside it


def test_dollar_signs_in_a_run_and_its_sources_are_text_not_markup(
    ch_client, ch_database, tmp_path
) -> None:
    """Issue 14: a `$` in a label was read as matplotlib mathtext and the report crashed."""
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    run = "price$run$1"
    write_simulated_run(
        sink, simulated_run(run, steps=30, sources=(("a$b", 0.5), ("$\\frac{$", 0.5)))
    )
    html, [png] = write_report(ch_client, ch_database, [run], tmp_path)
    assert png.stat().st_size > 0 and "a$b" in html.read_text()
    labels = {
        line.get_label()
        for line in _panels(render_first_screen(load_first_screen(ch_client, ch_database, run)))[
            "source"
        ].get_lines()
    }
    assert labels == {"a$b (50% of tokens)", "$\\frac{$ (50% of tokens)"}


def test_runs_lists_each_runs_user_metrics(own_store, store_url, monkeypatch, capsys) -> None:
    """``probewire runs`` names a run's user metrics: the first four, then how many more."""
    client, database = own_store
    monkeypatch.setenv("PROBEWIRE_CLICKHOUSE__DATABASE", database)
    ClickHouseSink(client, database).write(
        "user_metrics",
        [
            {"run_id": RUN, "step": step, "name": name, "value": 0.5, "reduction": "mean"}
            for name in ("m5", "m1", "eval/acc", "m3", "m2", "m4")
            for step in (0, 1)
        ]
        + [{"run_id": OTHER, "step": 3, "name": "val_acc", "value": 1.0, "reduction": "rank0"}],
    )
    assert main(["runs", "--clickhouse-url", store_url]) == 0
    out = capsys.readouterr().out
    assert "user_metrics" in out
    [mine] = [line for line in out.splitlines() if RUN in line]
    [other] = [line for line in out.splitlines() if OTHER in line]
    assert "eval/acc m1 m2 m3 +2" in mine and "val_acc" in other
