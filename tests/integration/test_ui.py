"""``probewire ui`` over HTTP, a real process reading the embedded store through a live
reader: the runs table in the server's HTML, the JSON the charts read (downsampled in SQL:
a 200,000-step run's every panel at most 2,000 points a series, its one-step spike kept),
a live update, the step and anomalies pages of a simulated run."""

from __future__ import annotations

import html
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from ui_support import LR, UI, get, ui_server, write_run, write_user_metric

from probewire.deploy.demo.faults import LayerExplosion
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run
from probewire.deploy.ui.app import NO_BROKER
from probewire.sinks import ClickHouseSink
from probewire.sinks.downsample import MAX_POINTS
from probewire.stream.series import CHARTS

pytestmark = pytest.mark.integration
LONG, SIM = "long-200k", "sim-run"
SPIKE = 123_457


@pytest.fixture()
def chdb_path(store_url: str) -> Path:
    if not store_url.startswith("chdb:///"):
        pytest.skip("the UI test serves an embedded (chdb) store through a live reader")
    return Path(store_url[len("chdb://") :])


@pytest.fixture()
def ui(chdb_path, ch_client, ch_database):
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    write_run(sink, LONG, 200_000, spike=SPIKE, tags=("long", "baseline"), status="finished")
    write_simulated_run(
        sink,
        simulated_run(
            SIM, steps=160, seed=0, faults=(LayerExplosion(layer=2, step=130, scale=50.0),)
        ),
    )
    with ui_server(chdb_path, ch_database) as url:
        yield url, sink


def _charts(url: UI, **params) -> dict:
    query = urllib.parse.urlencode({"run": LONG, **params})
    status, body = get(url.url(f"/api/charts?{query}"))
    assert status == 200, body
    return json.loads(body)


def test_200k_step_run_every_panel_bounded_spike_kept(ui):
    url, _ = ui
    started = time.monotonic()
    data = _charts(url)
    elapsed = time.monotonic() - started
    assert data["last_step"] == 199_999
    drawn = {key: lines for key, lines in data["charts"].items() if lines}
    assert {"loss", "lr", "grad", "cospike", "time", "throughput", "memory"} <= set(drawn)
    for key, lines in drawn.items():
        for line in lines:
            assert 0 < len(line["x"]) <= MAX_POINTS, (key, line["label"], len(line["x"]))
            assert line["x"] == sorted(line["x"])
    (grad,) = drawn["grad"]
    peak = max(range(len(grad["y"])), key=grad["y"].__getitem__)
    assert (grad["x"][peak], grad["y"][peak]) == (SPIKE, 1e4)  # the spike, at its step
    (lr,) = drawn["lr"]
    assert set(lr["y"]) == {LR}  # drawn as the value it is (never smoothed, never 0)
    (memory,) = drawn["memory"]
    assert 55 < max(memory["y"]) < 65  # GiB: the registry's scale
    for x in ("tokens", "flops"):  # every x axis is downsampled
        other = _charts(url, x=x)
        (g,) = other["charts"]["grad"]
        assert len(g["x"]) <= MAX_POINTS and max(g["y"]) == 1e4
    print(f"\n/api/charts of the 200,000-step run, all {len(CHARTS)} panels: {elapsed:.2f}s")


def test_zoomed_window_reads_finer_buckets(ui):
    url, _ = ui
    data = _charts(url, lo=SPIKE - 500, hi=SPIKE + 500)
    (grad,) = data["charts"]["grad"]
    assert data["window"]["width"] == 2.0  # 1001 steps over 666 buckets
    assert min(grad["x"]) >= SPIKE - 500 and max(grad["x"]) <= SPIKE + 500
    assert max(grad["y"]) == 1e4
    (loss,) = [line for line in data["charts"]["loss"] if line["label"] != "loss_worst_rank"][:1]
    assert len(loss["x"]) > 600  # finer than the whole run's width of 301 steps


def test_live_update_returns_only_new_steps(ui):
    url, sink = ui
    full = _charts(url)
    write_run(sink, LONG, 200_050, start=200_000, status="running")
    window = full["window"]
    update = _charts(url, after=full["last_step"], lo=window["lo"], width=window["width"])
    assert update["last_step"] == 200_049
    (grad,) = update["charts"]["grad"]
    assert min(grad["x"]) > 199_999 and max(grad["x"]) == 200_049


def test_runs_table_is_in_the_html_and_filters(ui):
    url, _ = ui
    status, page = get(url.url("/"))
    assert status == 200
    assert f"href='/run/{LONG}'" in page and f"href='/run/{SIM}'" in page
    assert "<script" not in page  # the table needs no script
    # no broker (started without --broker): notes read-only, the reason in one line
    assert f"<p class='muted' id='notes-read-only'>{html.escape(NO_BROKER)}</p>" in page
    assert "method='post'" not in page
    request = urllib.request.Request(url.url(f"/run/{LONG}/note"), data=b"note=n")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 409 and refused.value.read().decode() == NO_BROKER + "\n"
    _, only = get(url.url("/?q=tag%3Along"))
    assert f"/run/{LONG}'" in only and f"/run/{SIM}'" not in only
    _, by_text = get(url.url("/?q=sim"))
    assert f"/run/{SIM}'" in by_text and f"/run/{LONG}'" not in by_text
    _, runs = get(url.url("/api/runs"))
    rows = {r["run_id"]: r for r in json.loads(runs)}
    assert rows[LONG]["steps"] == 200_000 and rows[LONG]["tags"] == ["long", "baseline"]
    assert rows[LONG]["pages"] == 1 and rows[LONG]["world_size"] == 8


def test_step_anomalies_and_errors(ui):
    url, _ = ui
    status, page = get(url.url(f"/run/{SIM}/anomalies"))
    assert status == 200 and f"/run/{SIM}/step/" in page
    _, marks = get(url.url(f"/api/marks?run={SIM}"))
    anomalies = json.loads(marks)["anomalies"]
    assert anomalies, "the simulated explosion is flagged"
    step = anomalies[0]["step"]
    status, page = get(url.url(f"/run/{SIM}/step/{step}"))
    assert status == 200 and "What moved (explain)" in page and "Per tensor" in page
    status, page = get(url.url(f"/run/{SIM}/step/130"))  # a retained step of the explosion
    assert status == 200 and "not retained" not in page
    assert get(url.url("/run/nope"))[0] == 404
    assert get(url.url(f"/api/charts?run={LONG}&x=time"))[0] == 400
    assert get(url.url("/api/charts"))[0] == 400
    status, page = get(url.url(f"/run/{LONG}"))
    assert status == 200 and "/static/ui.js" in page
    assert get(url.url("/static/plotly.min.js"))[0] == 200


def test_without_its_token_the_ui_answers_nothing(ui):
    url, _ = ui
    for path in ("/", f"/run/{LONG}", "/api/runs", f"/api/charts?run={LONG}", "/static/ui.js"):
        status, body = get(url.base + path)
        assert status == 403 and "needs its token" in body and LONG not in body
    assert get(url.base + "/api/runs?token=" + "x" * len(url.token))[0] == 403
    # the printed URL's token sets a cookie the same origin's requests then carry
    with urllib.request.urlopen(url.url("/"), timeout=60) as response:
        cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    request = urllib.request.Request(
        url.base + "/api/runs", headers={"Cookie": cookie.split(";")[0]}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert LONG in response.read().decode()


def test_step_detail_depth_profile_matches_numpy(ch_client, ch_database):
    from probewire.deploy.ui import queries

    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    run = simulated_run(
        SIM, steps=160, seed=0, faults=(LayerExplosion(layer=2, step=130, scale=50.0),)
    )
    write_simulated_run(sink, run)
    detail = queries.step_rows(ch_client, ch_database, SIM, 130)
    assert len(detail["tensors"]) == 20 and detail["ranks"]
    layer_of = dict(
        ch_client.query(
            f"SELECT tensor, layer FROM {ch_database}.tensor_names FINAL WHERE run_id = '{SIM}'"
        ).result_rows
    )
    expected: dict[tuple[int, str], list[float]] = {}
    for row in detail["tensors"]:
        if layer_of.get(row["tensor"]) is not None:
            expected.setdefault((layer_of[row["tensor"]], row["kind"]), []).append(row["rms"])
    got = {(r["layer"], r["kind"]): r["rms"] for r in detail["depth"]}
    assert set(got) == set(expected)
    for key, values in expected.items():
        assert got[key] == pytest.approx(
            float(np.mean(np.array(values, dtype=np.float64))), rel=1e-12
        )


def test_an_unmigrated_store_is_one_line_not_a_traceback(chdb_path, ch_client, ch_database):
    with ui_server(chdb_path, ch_database) as url:
        status, body = get(url.url("/"))
    assert status == 500 and body.startswith("the store refused the query: ")
    assert body.count("\n") == 1 and "Traceback" not in body


def test_loss_by_source_on_every_x_axis(ui):
    url, _ = ui
    by_axis = {}
    for x in ("step", "tokens", "flops"):
        status, body = get(url.url(f"/api/charts?run={SIM}&x={x}"))
        assert status == 200, body
        by_axis[x] = {line["label"]: line for line in json.loads(body)["charts"]["source"]}
    assert set(by_axis["step"]) == {"web", "code", "math"}
    for source, line in by_axis["step"].items():
        for x in ("tokens", "flops"):  # the same points, each at its step's tokens / FLOPs
            assert by_axis[x][source]["y"] == line["y"]
            assert len(by_axis[x][source]["x"]) == len(line["x"])
            assert by_axis[x][source]["x"] == sorted(by_axis[x][source]["x"])


def test_user_metric_is_a_panel_of_its_stored_values(ui):
    """A run's ``s.log('val_acc', ...)`` (mean over 8 ranks) is the panel ``user:val_acc``:
    on every x axis, the stored values at their steps (a NaN not drawn), the reduction in
    the panel's title; a live update returns only its new steps."""
    url, sink = ui
    steps = list(range(0, 150, 10))
    per_rank = np.random.default_rng(3).uniform(0.1, 0.9, (len(steps), 8))
    per_rank[4, 2] = np.nan  # one rank's NaN: the step's mean is NaN, stored, not drawn
    stored = write_user_metric(sink, SIM, "val_acc", per_rank, steps)
    expected = per_rank.astype(np.float64).mean(axis=1)
    assert np.array_equal(stored, expected, equal_nan=True)
    kept = [i for i, v in enumerate(expected) if np.isfinite(v)]
    step_x = {}
    for x in ("step", "tokens", "flops"):
        status, body = get(url.url(f"/api/charts?run={SIM}&x={x}"))
        assert status == 200, body
        data = json.loads(body)
        assert data["user_panels"] == [
            {
                "key": "user:val_acc",
                "title": "val_acc (your metric; mean over ranks)",
                "unit": "as logged",
                "log": False,
                "count": False,
                "smooth": True,
                "signals": [],
            }
        ]
        (line,) = data["charts"]["user:val_acc"]
        assert (line["run"], line["label"]) == (SIM, "val_acc")
        assert line["y"] == [float(expected[i]) for i in kept]
        step_x[x] = line["x"]
        assert "user" not in data["charts"]
    assert step_x["step"] == [float(steps[i]) for i in kept]
    rows = {
        s: (t, f)
        for s, t, f in sink.client.query(
            f"SELECT step, tokens, flops FROM {sink.database}.step_metrics "
            "WHERE run_id = {run:String}",
            parameters={"run": SIM},
        ).result_rows
    }
    assert step_x["tokens"] == [float(rows[steps[i]][0]) for i in kept]
    assert step_x["flops"] == [float(rows[steps[i]][1]) for i in kept]
    # live: only what came after
    later = write_user_metric(sink, SIM, "val_acc", np.full((1, 8), 0.25), [155])
    status, body = get(url.url(f"/api/charts?run={SIM}&after=150&lo=0&width=1"))
    (line,) = json.loads(body)["charts"]["user:val_acc"]
    assert line["x"] == [155.0] and line["y"] == [float(later[0])]
