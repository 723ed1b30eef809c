"""The first-screen report of a recorded run: nine raw panels, anomalies marked, one HTML file."""

from __future__ import annotations

import base64
import re

import numpy as np
import pytest

from probewire.deploy.cli import main
from probewire.deploy.report import (PANELS, RunNotFound, load_first_screen,
                                     render_first_screen, write_report)
from probewire.sinks import ClickHouseSink
from probewire.deploy.demo.faults import LayerExplosion
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run

RUN = "report-run"


@pytest.fixture()
def store(ch_client, ch_database):
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    write_simulated_run(sink, simulated_run(RUN, steps=150, faults=(
        LayerExplosion(layer=2, step=130, scale=50.0),)))
    return ch_client, ch_database


def _panels(fig) -> dict:
    return {ax.get_label()[len("panel:"):]: ax for ax in fig.axes
            if ax.get_label().startswith("panel:")}


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


def test_anomalies_are_marked_on_their_panels_at_their_tokens(store) -> None:
    data = load_first_screen(*store, RUN)
    panels = _panels(render_first_screen(data))
    tokens = dict(zip(data.steps["step"].astype(int), data.steps["tokens"]))

    def marks(key: str) -> list[float]:
        return [x for line in panels[key].get_lines() if line.get_gid() == "anomaly"
                for x in line.get_xdata()]

    assert sorted(marks("grad")) == [tokens[130]]
    assert marks("cospike") == [tokens[130]]
    assert marks("loss") == [tokens[130]]
    assert marks("memory") == []
    assert all(any(line.get_gid() == "alert" for line in ax.get_lines())
               for ax in panels.values())  # the page is a line across every panel


def test_write_report_produces_a_png_and_a_self_contained_html(store, tmp_path) -> None:
    html_path, png_path = write_report(*store, RUN, tmp_path / "out")
    png = png_path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    html = html_path.read_text()
    [embedded] = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert base64.b64decode(embedded) == png
    assert "http://" not in html and "https://" not in html
    client, db = store
    [(alerts, anomalies)] = client.query(
        f"SELECT (SELECT count() FROM {db}.alerts FINAL), "
        f"(SELECT count() FROM {db}.anomalies FINAL)").result_rows
    assert alerts >= 1 and anomalies >= 3
    assert f"Alerts ({alerts})" in html and f"Anomalies ({anomalies})" in html
    assert "cospike at step 130" in html  # the page's message


def test_a_missing_run_is_a_clear_error_naming_the_runs_that_exist(store, tmp_path) -> None:
    with pytest.raises(RunNotFound, match=f"'nope' has no steps.*{RUN}"):
        write_report(*store, "nope", tmp_path)
    assert not list(tmp_path.iterdir())


def test_the_cli_writes_the_report_and_explains_a_step(store, store_url, tmp_path, monkeypatch,
                                                       capsys) -> None:
    _, database = store
    monkeypatch.setenv("PROBEWIRE_CLICKHOUSE__DATABASE", database)
    assert main(["report", "--run", RUN, "--clickhouse-url", store_url,
                 "--out", str(tmp_path)]) == 0
    assert (tmp_path / f"{RUN}.html").is_file() and (tmp_path / f"{RUN}.png").is_file()
    assert main(["explain", "--run", RUN, "--step", "130", "--clickhouse-url", store_url,
                 "--format", "json"]) == 0
    out = capsys.readouterr().out
    assert '"first": "cospike_count"' in out and '"signal": "cospike"' in out
    assert main(["report", "--run", "nope", "--clickhouse-url", store_url]) == 2
    assert "has no steps" in capsys.readouterr().err
