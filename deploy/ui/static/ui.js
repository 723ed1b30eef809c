// probewire ui: the run and compare pages' charts (plotly.js), from /api/charts.
// One x range for every panel (zoom one, all follow; the data is read again, downsampled
// for the new range), log/linear per panel, smoothing only where the chart allows it,
// anomalies and pages marked on every panel, live: new steps appended every 1.5 s.
(function () {
  "use strict";
  const boot = JSON.parse(document.getElementById("boot").textContent);
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
    "#e377c2", "#17becf"];
  const DASHES = ["solid", "dot", "dash", "longdash", "dashdot"];
  const AXIS_TITLE = { step: "step", tokens: "cumulative tokens", flops: "cumulative FLOPs" };
  const state = {
    x: boot.x, range: null, window: null, lastX: null, lastStep: null, points: 0,
    data: null, marks: { anomalies: [], pages: [] }, log: {}, smooth: {}, syncing: 0,
    drawnAt: null, polls: 0, bound: {},
  };
  window.pwState = state;

  function query(params) {
    const u = new URLSearchParams();
    boot.runs.forEach((r) => u.append("run", r));
    Object.entries(params).forEach(([k, v]) => { if (v !== null && v !== undefined) u.set(k, v); });
    return u.toString();
  }

  async function getJSON(url) {
    const r = await fetch(url);
    if (!r.ok) throw new Error(url + ": " + r.status + " " + (await r.text()));
    return r.json();
  }

  function ema(ys, alpha) {
    let m = null;
    return ys.map((v) => {
      if (v === null || !isFinite(v)) return null;
      m = m === null ? v : alpha * v + (1 - alpha) * m;
      return m;
    });
  }

  function lineStyle(line, labels) {
    const run = boot.runs.indexOf(line.run);
    const dash = DASHES[labels.indexOf(line.label) % DASHES.length];
    return { color: COLORS[run % COLORS.length], width: 1.3, dash: dash };
  }

  function traces(chart, lines) {
    const labels = [...new Set(lines.map((l) => l.label))];
    const out = [];
    lines.forEach((line) => {
      const name = boot.runs.length > 1 ? line.run + " · " + line.label : line.label;
      const hover = "%{y:.5g} " + chart.unit + "<extra>" + name + "</extra>";
      out.push({ x: line.x.slice(), y: line.y.slice(), name: name, mode: "lines", type: "scatter",
        line: lineStyle(line, labels), hovertemplate: hover, meta: { key: line.run + "|" + line.label } });
      if (chart.smooth && state.smooth[chart.key]) {
        out.push({ x: line.x, y: ema(line.y, 0.1), name: name + " (smoothed)", mode: "lines",
          type: "scatter", line: Object.assign(lineStyle(line, labels), { width: 2.6 }),
          hovertemplate: hover, meta: { key: line.run + "|" + line.label + "|smooth" } });
      }
    });
    return out;
  }

  function shapes(chart) {
    const out = [];
    const add = (m, color, dash, width) => {
      const x = m[state.x];
      if (x === null || x === undefined) return;
      out.push({ type: "line", xref: "x", yref: "paper", x0: x, x1: x, y0: 0, y1: 1,
        line: { color: color, dash: dash, width: width } });
    };
    state.marks.pages.slice(0, 200).forEach((p) =>
      add(p, p.severity === "page" ? "#c00" : "#e69500", "dash", 1.2));
    state.marks.anomalies.slice(0, 300).forEach((a) =>
      add(a, "#ff7f0e", "dot", chart.signals.includes(a.signal) ? 1.6 : 0.6));
    return out;
  }

  // A flat series (a constant lr) gets an axis around its value, never plotly's -1..1
  // around it, where 0.003 reads as 0.
  function flatRange(lines, log) {
    let lo = Infinity, hi = -Infinity;
    lines.forEach((l) => l.y.forEach((v) => {
      if (v !== null && isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    }));
    if (!isFinite(lo) || hi - lo > 1e-9 * Math.max(Math.abs(hi), 1e-300)) return null;
    if (log && lo > 0) return [Math.log10(lo) - 0.5, Math.log10(lo) + 0.5];
    if (lo === 0) return [0, 1];
    return lo > 0 ? [0, 2 * lo] : [2 * lo, 0];
  }

  function layout(chart, lines) {
    const xaxis = { title: { text: AXIS_TITLE[state.x] }, exponentformat: "SI" };
    if (state.range) xaxis.range = state.range.slice();
    else xaxis.autorange = true;
    const log = state.log[chart.key] ?? chart.log;
    const yaxis = { title: { text: chart.unit }, type: log ? "log" : "linear",
      rangemode: chart.count ? "tozero" : "normal", exponentformat: "e" };
    const flat = flatRange(lines, log);
    if (flat) yaxis.range = flat;
    return {
      margin: { l: 60, r: 10, t: 10, b: 40 }, hovermode: "x unified", xaxis: xaxis, yaxis: yaxis,
      shapes: shapes(chart), showlegend: true,
      legend: { orientation: "h", y: -0.25, font: { size: 10 } },
    };
  }

  function panelOf(key) { return document.getElementById("panel-" + key); }

  // A user's own metrics (Monitor.log) are one panel per name, known from the data: a
  // name first seen (on load or in a live update) gets its panel after the registry's.
  function addPanels(specs) {
    (specs || []).forEach((spec) => {
      if (boot.charts.some((c) => c.key === spec.key)) return;
      boot.charts.push(spec);
      const section = document.createElement("section");
      section.className = "panel";
      section.id = "panel-" + spec.key;
      section.dataset.chart = spec.key;
      const bar = document.createElement("div");
      bar.className = "bar";
      const title = document.createElement("b");
      title.textContent = spec.title;
      const unit = document.createElement("span");
      unit.className = "muted";
      unit.textContent = "[" + spec.unit + "]";
      const plot = document.createElement("div");
      plot.className = "plot";
      bar.append(title, " ", unit);
      section.append(bar, plot);
      document.getElementById("panels").append(section);
    });
  }

  function controls(chart, panel) {
    if (panel.querySelector(".log")) return;
    const bar = panel.querySelector(".bar");
    const log = document.createElement("button");
    log.className = "log";
    log.textContent = "log / linear y";
    log.onclick = () => {
      state.log[chart.key] = !(state.log[chart.key] ?? chart.log);
      drawPanel(chart);
    };
    bar.append(" ", log);
    if (chart.smooth) {
      const label = document.createElement("label");
      label.innerHTML = " <input type='checkbox' class='smooth'> smooth";
      label.querySelector("input").onchange = (e) => {
        state.smooth[chart.key] = e.target.checked;
        drawPanel(chart);
      };
      bar.append(label);
    }
  }

  function drawPanel(chart) {
    const lines = (state.data.charts[chart.key] || []);
    const panel = panelOf(chart.key);
    const plot = panel.querySelector(".plot");
    if (!lines.length) {
      panel.style.display = "none";
      return false;
    }
    panel.style.display = "";
    controls(chart, panel);
    Plotly.react(plot, traces(chart, lines), layout(chart, lines), { displaylogo: false, responsive: true });
    if (!state.bound[chart.key]) {
      plot.on("plotly_relayout", (ev) => onRelayout(chart.key, ev));
      state.bound[chart.key] = true;
    }
    return true;
  }

  function foldedNote(folded) {
    const list = document.getElementById("folded");
    list.innerHTML = "";
    folded.forEach((c) => {
      const li = document.createElement("li");
      li.textContent = c.title + ": no data in this range (not measured by these runs)";
      li.dataset.chart = c.key;
      list.append(li);
    });
  }

  function track() {
    let last = null, n = 0;
    Object.values(state.data.charts).forEach((lines) => lines.forEach((l) => {
      n += l.x.length;
      if (l.x.length && (last === null || l.x[l.x.length - 1] > last)) last = l.x[l.x.length - 1];
    }));
    state.points = n;
    if (last !== null && (state.lastX === null || last > state.lastX)) state.lastX = last;
  }

  function showLast() {
    document.getElementById("last-step").textContent =
      state.lastStep === null ? "-" : String(state.lastStep);
  }

  async function drawAll(pending) {
    const lo = state.range ? state.range[0] : null;
    const hi = state.range ? state.range[1] : null;
    state.data = await (pending || getJSON("/api/charts?" + query({ x: state.x, lo: lo, hi: hi })));
    state.window = state.data.window;
    state.lastStep = state.data.last_step;
    state.lastX = null;
    addPanels(state.data.user_panels);
    const folded = [];
    boot.charts.forEach((c) => { if (!drawPanel(c)) folded.push(c); });
    foldedNote(folded);
    track();
    showLast();
    if (state.drawnAt === null) state.drawnAt = performance.now();
    document.getElementById("state").textContent = state.data.window
      ? "bucket width " + state.data.window.width.toPrecision(3) + " " + state.x
      : "no steps yet";
  }

  let redraw = null;
  function onRelayout(key, ev) {
    if (state.syncing) return;
    let range;
    if (ev["xaxis.range[0]"] !== undefined) range = [ev["xaxis.range[0]"], ev["xaxis.range[1]"]];
    else if (ev["xaxis.range"]) range = ev["xaxis.range"];
    else if (ev["xaxis.autorange"]) range = null;
    else return;
    state.range = range;
    state.syncing += 1;
    const others = boot.charts.filter((c) => c.key !== key && panelOf(c.key).style.display !== "none");
    Promise.all(others.map((c) => Plotly.relayout(panelOf(c.key).querySelector(".plot"),
      range ? { "xaxis.range": range.slice() } : { "xaxis.autorange": true })))
      .finally(() => { state.syncing -= 1; });
    clearTimeout(redraw);
    redraw = setTimeout(() => drawAll().catch(report), 300);
  }

  function extend(update) {
    let added = 0;
    addPanels(update.user_panels);
    boot.charts.forEach((chart) => {
      const lines = update.charts[chart.key] || [];
      if (!lines.length) return;
      const panel = panelOf(chart.key);
      const have = state.data.charts[chart.key] || [];
      lines.forEach((line) => {
        const old = have.find((l) => l.run === line.run && l.label === line.label);
        if (old) { old.x.push(...line.x); old.y.push(...line.y); } else have.push(line);
        added += line.x.length;
      });
      state.data.charts[chart.key] = have;
      const plot = panel.querySelector(".plot");
      if (panel.style.display === "none" || state.smooth[chart.key] || !plot.data) {
        drawPanel(chart);
        return;
      }
      lines.forEach((line) => {
        const index = plot.data.findIndex((t) => t.meta && t.meta.key === line.run + "|" + line.label);
        if (index >= 0) Plotly.extendTraces(plot, { x: [line.x], y: [line.y] }, [index]);
        else drawPanel(chart);
      });
    });
    return added;
  }

  async function poll() {
    state.polls += 1;
    if (!state.window) return drawAll();
    if (state.polls % 7 === 0) await loadMarks();
    if (state.range) {  // zoomed: the view stays, the step count moves on
      const u = await getJSON("/api/charts?" + query({ x: state.x, after: state.lastX,
        lo: state.window.lo, width: state.window.width }));
      state.lastStep = u.last_step;
      return showLast();
    }
    const update = await getJSON("/api/charts?" + query({ x: state.x, after: state.lastX,
      lo: state.window.lo, width: state.window.width }));
    state.lastStep = update.last_step;
    extend(update);
    track();
    showLast();
    if (state.points > 1.5 * state.data.max_points) await drawAll();  // re-bucket
  }

  async function loadMarks() {
    state.marks = await getJSON("/api/marks?" + query({}));
  }

  function report(err) {
    document.getElementById("state").textContent = "error: " + err.message;
  }

  document.getElementById("xaxis").onchange = (e) => {
    state.x = e.target.value;
    state.range = null;
    const u = new URL(location.href);
    u.searchParams.set("x", state.x);
    history.replaceState(null, "", u);
    drawAll().catch(report);
  };

  async function loop() {
    try { await poll(); } catch (err) { report(err); }
    setTimeout(loop, 1500);
  }

  // the page asked for the charts and the marks before plotly.js was parsed (pwFirst)
  const [first, marks] = window.pwFirst ||
    [getJSON("/api/charts?" + query({ x: state.x })), getJSON("/api/marks?" + query({}))];
  marks.then((m) => { state.marks = m; }).then(() => drawAll(first))
    .then(() => { if (boot.live) setTimeout(loop, 1500); }).catch(report);
})();
