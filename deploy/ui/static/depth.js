// probewire ui: a step's depth profiles (R_b per layer and branch, RMS per layer and kind).
(function () {
  "use strict";
  const data = JSON.parse(document.getElementById("depth-data").textContent);
  const traces = [];
  const by = (rows, key) => rows.reduce((m, r) => ((m[r[key]] = m[r[key]] || []).push(r), m), {});
  Object.entries(by(data.residual, "branch")).forEach(([branch, rows]) =>
    traces.push({ x: rows.map((r) => r.layer), y: rows.map((r) => r.ratio), mode: "lines+markers",
      name: "R_b " + branch }));
  Object.entries(by(data.depth, "kind")).forEach(([kind, rows]) =>
    traces.push({ x: rows.map((r) => r.layer), y: rows.map((r) => r.rms), mode: "lines+markers",
      name: "mean RMS " + kind, yaxis: "y2" }));
  const div = document.getElementById("depth");
  if (!traces.length) {
    div.textContent = "no depth profile at this step (not retained, or not measured)";
    div.style.height = "auto";
    return;
  }
  Plotly.newPlot(div, traces, {
    margin: { l: 60, r: 60, t: 10, b: 40 }, hovermode: "x unified",
    xaxis: { title: { text: "layer" } }, yaxis: { title: { text: "R_b" } },
    yaxis2: { title: { text: "RMS" }, overlaying: "y", side: "right", type: "log" },
  }, { displaylogo: false });
})();
