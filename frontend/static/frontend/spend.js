"use strict";
// The spend page's chart: cost and calls per period, drawn with the vendored uPlot
// (uplot.min.js, VENDORED.md) from the JSON the page carries in #spend-data.
(function () {
  function draw() {
    const root = document.getElementById("spend-chart");
    const data = document.getElementById("spend-data");
    if (!root || !data || typeof uPlot === "undefined") return;
    const d = JSON.parse(data.textContent);
    const width = Math.max(320, Math.min(root.clientWidth || 900, 1300));
    const opts = {
      width: width,
      height: 280,
      series: [
        {},
        { label: "cost (US$)", stroke: "#2563eb", width: 2, scale: "usd",
          points: { show: true, size: 5 },
          value: (u, v) => (v === null ? "–" : v.toFixed(6)) },
        { label: "calls", stroke: "#16a34a", width: 1, scale: "calls",
          points: { show: true, size: 4 } },
      ],
      axes: [
        {},
        { scale: "usd", label: "US$", values: (u, vals) => vals.map((v) => v.toFixed(4)) },
        { scale: "calls", side: 1, label: "calls", grid: { show: false } },
      ],
      // The range asked for, however few periods had calls.
      scales: { x: { time: true, range: [d.from, d.to] },
                usd: { range: (u, lo, hi) => [0, Math.max(hi, 1e-6) * 1.1] },
                calls: { range: (u, lo, hi) => [0, Math.max(hi, 1) * 1.1] } },
    };
    root.classList.add("drawn");
    new uPlot(opts, [d.t, d.cost, d.calls], root);
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", draw);
  } else {
    draw();
  }
})();
