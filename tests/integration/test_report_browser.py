"""The two-run report in headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by selenium): a real mouse hover reads a point's value, the x axis switch moves both
runs to FLOPs, smoothing adds lines beside the raw series; a screenshot is kept in the test's
tmp dir (``--basetemp DIR`` to choose where)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from chromium import headless_chromium, needs_chromium

from probewire.deploy.demo.faults import LayerExplosion
from probewire.deploy.demo.simulate import simulated_run, write_simulated_run
from probewire.deploy.report import load_first_screen, write_report
from probewire.sinks import ClickHouseSink

pytestmark = needs_chromium
RUN, OTHER = "baseline", "lr-x2"


@pytest.fixture()
def report(ch_client, ch_database, tmp_path):
    sink = ClickHouseSink(ch_client, ch_database)
    sink.migrate()
    write_simulated_run(
        sink,
        simulated_run(
            RUN, steps=160, seed=0, faults=(LayerExplosion(layer=2, step=130, scale=50.0),)
        ),
    )
    write_simulated_run(
        sink, simulated_run(OTHER, steps=120, seed=3, sources=(("web", 0.5), ("code", 0.5)))
    )
    path, _ = write_report(ch_client, ch_database, [RUN, OTHER], tmp_path / "report")
    return path, {r: load_first_screen(ch_client, ch_database, r) for r in (RUN, OTHER)}


@pytest.fixture()
def browser():
    with headless_chromium(1500, 1900) as driver:
        yield driver


def _wait(driver, script: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for: {script}")


def _ema(y: np.ndarray, alpha: float) -> np.ndarray:
    out, m = np.full_like(y, np.nan), None
    for i, v in enumerate(y):
        if np.isfinite(v):
            m = v if m is None else alpha * m + (1 - alpha) * v
            out[i] = m
    return out


def test_two_run_report_hover_axis_switch_overlay_and_screenshot(report, browser, tmp_path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    path, data = report
    browser.get(path.as_uri())
    _wait(browser, "return document.body.dataset.ready === '1'")
    loss = browser.find_element(By.ID, "chart-loss")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", loss)

    # hover with the mouse over OTHER's L at step 60: the label shows that stored value
    step = 60
    y = float(data[OTHER].steps["loss"][step])
    x = float(data[OTHER].steps["tokens"][step])
    px, py, w, h = browser.execute_script(
        """
        const d = arguments[0], xa = d._fullLayout.xaxis, ya = d._fullLayout.yaxis;
        const r = d.getBoundingClientRect();
        return [xa._offset + xa.l2p(arguments[1]), ya._offset + ya.l2p(arguments[2]),
                r.width, r.height];""",
        loss,
        x,
        y,
    )
    ActionChains(browser).move_to_element_with_offset(
        loss, int(round(px - w / 2)), int(round(py - h / 2))
    ).perform()
    text = _wait(
        browser,
        "const t = document.querySelector('#chart-loss .hoverlayer .hovertext');"
        "return t && Array.from(t.querySelectorAll('tspan.line')).map(e => e.textContent)"
        ".join('\\n');",
        10,
    )
    # the label names the nearest point's trace (L and L_max of both runs lie close):
    # its value is that trace's stored value at the nearest stored tokens
    import re

    match = re.fullmatch(rf"({RUN}|{OTHER}) · (L_max|L)\n(.+)\n([-\d.e+]+) nats/token", text)
    assert match, text
    run, column = match[1], {"L": "loss", "L_max": "loss_worst_rank"}[match[2]]
    nearest = int(np.argmin(np.abs(data[run].steps["tokens"] - x)))
    assert abs(nearest - step) <= 1 if run == OTHER else True
    assert match[4] in {
        f"{data[run].steps[column][i]:.5g}" for i in range(max(nearest - 1, 0), nearest + 2)
    }, text

    # both runs drawn on the chart's one x axis, tokens first
    traces = browser.execute_script(
        "return arguments[0].data.filter(t => t.meta.role === 'raw')"
        ".map(t => [t.meta.run, t.meta.label, t.xaxis || 'x', t.x.length]);",
        loss,
    )
    assert {(r, a) for r, _, a, _ in traces} == {(RUN, "x"), (OTHER, "x")}

    # switch to FLOPs: every run's x values are its stored cumulative FLOPs
    Select(browser.find_element(By.ID, "pw-x")).select_by_value("flops")
    _wait(browser, "return document.body.dataset.xaxis === 'flops'")
    for run in (RUN, OTHER):
        xs = browser.execute_script(
            "return arguments[0].data.find(t => t.meta.role === 'raw' && t.meta.run === "
            "arguments[1] && t.meta.label === 'L').x;",
            loss,
            run,
        )
        np.testing.assert_array_equal(np.array(xs, dtype=float), data[run].steps["flops"])
    title, span = browser.execute_script(
        "const xa = arguments[0]._fullLayout.xaxis; return [xa.title.text, xa.range];", loss
    )
    assert title == "cumulative FLOPs"
    top = max(float(data[r].steps["flops"][-1]) for r in (RUN, OTHER))
    assert span[0] <= float(data[OTHER].steps["flops"][0]) and span[1] >= top  # overlay

    # smoothing on: smoothed lines appear, the raw ones stay visible
    browser.execute_script(
        "const s = document.getElementById('pw-smooth'); s.value = '0.9';"
        "s.dispatchEvent(new Event('input'));"
    )
    state = browser.execute_script(
        "return arguments[0].data.map(t => [t.meta.role, t.meta.run, t.meta.label, t.visible,"
        " t.y]);",
        loss,
    )
    raw = [s for s in state if s[0] == "raw"]
    smooth = [s for s in state if s[0] == "smooth"]
    assert raw and all(s[3] is True for s in raw) and all(s[3] is True for s in smooth)
    [(*_, smoothed)] = [s for s in smooth if s[1] == OTHER and s[2] == "L"]
    np.testing.assert_allclose(
        np.array(smoothed, dtype=float), _ema(data[OTHER].steps["loss"], 0.9), rtol=1e-12
    )

    browser.execute_script("window.scrollTo(0, 0)")
    shot = tmp_path / "report-two-runs.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
