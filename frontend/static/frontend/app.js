"use strict";
// The admin UI's only script, no dependencies: the live dashboard (Server-Sent Events
// drawn as SVG line charts), the audit export's progress bar, local times. Every text
// it shows goes in through textContent, never as HTML.
(function () {
  const HISTORY = 120; // points per series: two minutes at one a second
  const SVG = "http://www.w3.org/2000/svg";
  const COLORS = ["#2563eb", "#dc2626", "#16a34a"];

  function draw(svg, series) {
    const width = 300, height = 80;
    svg.setAttribute("viewBox", `0 0 ${width} ${height + 12}`);
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const values = series.flatMap((s) => s.filter((v) => v !== null));
    const top = Math.max(1e-9, ...values, 0);
    series.forEach((points, i) => {
      const line = document.createElementNS(SVG, "polyline");
      const step = width / (HISTORY - 1);
      const offset = HISTORY - points.length;
      line.setAttribute("points", points.map((v, j) =>
        `${((offset + j) * step).toFixed(1)},${(height - ((v || 0) / top) * height).toFixed(1)}`
      ).join(" "));
      line.setAttribute("fill", "none");
      line.setAttribute("stroke", COLORS[i % COLORS.length]);
      line.setAttribute("stroke-width", "1.5");
      svg.appendChild(line);
    });
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", "2");
    label.setAttribute("y", String(height + 11));
    const last = series.map((s) => s[s.length - 1]).map((v) => v === null || v === undefined
      ? "–" : (Math.round(v * 100) / 100).toString());
    label.textContent = `now ${last.join(" / ")} · max ${Math.round(top * 100) / 100}`;
    svg.appendChild(label);
  }

  function dashboard(root) {
    const template = document.getElementById("deployment-card");
    const status = document.getElementById("live-status");
    const cards = new Map();

    function card(name) {
      if (!cards.has(name)) {
        const node = template.content.firstElementChild.cloneNode(true);
        node.dataset.deployment = name;
        node.querySelector(".name").textContent = name;
        root.appendChild(node);
        cards.set(name, { node, history: {}, last: null });
      }
      return cards.get(name);
    }

    function update(data) {
      for (const d of data.deployments) {
        const c = card(d.name);
        const batches = c.last && d.batch_count > c.last.batch_count
          ? (d.batch_sum - c.last.batch_sum) / (d.batch_count - c.last.batch_count) : null;
        c.last = d;
        const point = { ...d, batch_mean: batches };
        for (const [key, value] of Object.entries(point)) {
          const h = (c.history[key] = c.history[key] || []);
          h.push(typeof value === "number" ? value : null);
          if (h.length > HISTORY) h.shift();
        }
        c.node.querySelector(".facts").textContent =
          `breaker ${d.breaker} · ${d.workers} worker(s) live, ${d.in_rotation} in rotation, ` +
          `${d.desired ?? "–"} desired · ${d.qps} QPS · p99 ${d.p99_ms ?? "–"} ms`;
        c.node.classList.toggle("open", d.breaker === "open");
        for (const figure of c.node.querySelectorAll("figure")) {
          const keys = figure.dataset.series.split(",");
          draw(figure.querySelector("svg"), keys.map((k) => c.history[k] || []));
        }
      }
    }

    update(JSON.parse(document.getElementById("snapshot").textContent));
    const source = new EventSource(root.dataset.stream);
    source.onmessage = (event) => {
      status.textContent = "live";
      update(JSON.parse(event.data));
    };
    source.onerror = () => { status.textContent = "reconnecting…"; };
  }

  function exportProgress(root) {
    const bar = document.getElementById("export-progress");
    const text = document.getElementById("export-status");
    const link = document.getElementById("export-link");
    async function poll() {
      const response = await fetch(root.dataset.poll, { credentials: "same-origin" });
      if (response.ok) {
        const s = await response.json();
        bar.max = Math.max(1, s.total);
        bar.value = s.done;
        text.textContent = `${s.status}: ${s.done} of ${s.total} events` +
          (s.error ? ` (${s.error})` : "");
        if (s.status === "done") { link.hidden = false; return; }
        if (s.status === "failed") return;
      }
      setTimeout(poll, 500);
    }
    poll();
  }

  document.addEventListener("DOMContentLoaded", () => {
    const dash = document.getElementById("dashboard");
    if (dash) dashboard(dash);
    const exp = document.getElementById("export");
    if (exp) exportProgress(exp);
    for (const cell of document.querySelectorAll("[data-ts]")) {
      cell.textContent = new Date(parseFloat(cell.dataset.ts) * 1000).toLocaleString();
    }
  });
})();
