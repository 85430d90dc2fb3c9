// The overview's charts: drawn from the figures the server built, then kept fresh by the live
// WebSocket (ws/console/live), which sends the same payload every few seconds.
"use strict";

(function () {
  const script = document.getElementById("overview-script");
  const initial = JSON.parse(document.getElementById("overview-data").textContent);
  const status = document.getElementById("live-status");
  const toggle = document.getElementById("live-toggle");
  const config = { responsive: true, displaylogo: false };
  let socket = null;
  let paused = false;
  let updates = 0;

  // The legend sits beside a chart; below it where the chart is too narrow to share its width.
  function fitted(layout, element) {
    if (element.clientWidth >= 560 || !layout.showlegend) return layout;
    return Object.assign({}, layout, { legend: { orientation: "h", y: -0.2, yanchor: "top" }, height: layout.height + 80 });
  }

  // Times read in UTC, as every time on the console does.
  function utcTime(iso) {
    return new Date(iso).toISOString().slice(11, 19) + " UTC";
  }

  function draw(data, first) {
    for (const [key, figure] of Object.entries(data.figures)) {
      const element = document.getElementById("chart-" + key);
      if (!element) continue;
      figure.layout = fitted(figure.layout, element);
      if (first) {
        Plotly.newPlot(element, figure.data, figure.layout, config);
      } else {
        Plotly.react(element, figure.data, figure.layout, config);
      }
    }
    for (const [key, value] of Object.entries(data.headline)) {
      const element = document.querySelector('[data-headline="' + key + '"]');
      if (element) element.textContent = value;
    }
    if (!first) renderRows(data.rows);
  }

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  function renderRows(rows) {
    const body = document.querySelector("#version-table tbody");
    const columns = ["model", "version", "requests", "requests_per_second", "output_tokens_per_second",
      "latency_p50_ms", "latency_p99_ms", "ttft_p50_ms", "error_rate", "cancelled", "cache_hit_rate"];
    const fresh = [];
    for (const row of rows) {
      const tr = document.createElement("tr");
      tr.dataset.versionRow = row.model + ":" + row.version;
      for (const column of columns) tr.appendChild(cell(row[column]));
      fresh.push(tr);
    }
    if (fresh.length === 0) {
      const tr = document.createElement("tr");
      const td = cell("No traffic in this window.");
      td.colSpan = columns.length;
      td.className = "empty";
      tr.appendChild(td);
      fresh.push(tr);
    }
    body.replaceChildren(...fresh);
  }

  function showGateway(gateway) {
    for (const [key, value] of Object.entries(gateway || {})) {
      const element = document.querySelector('[data-gateway="' + key + '"]');
      if (element) element.textContent = value;
    }
  }

  function connect() {
    const scheme = window.location.protocol === "https:" ? "wss://" : "ws://";
    const url = scheme + window.location.host + script.dataset.livePath + "?range=" + encodeURIComponent(script.dataset.range);
    socket = new WebSocket(url);
    socket.addEventListener("open", function () { status.textContent = "Connected, waiting for the first update…"; });
    socket.addEventListener("message", function (event) {
      const message = JSON.parse(event.data);
      if (message.type !== "overview") return;
      draw(message, false);
      showGateway(message.gateway);
      updates += 1;
      status.dataset.updates = String(updates);
      status.textContent = "Live · updated " + utcTime(message.at);
    });
    socket.addEventListener("close", function () {
      socket = null;
      if (paused) return;
      status.textContent = "Disconnected; retrying in 5 s…";
      window.setTimeout(function () { if (!paused && socket === null) connect(); }, 5000);
    });
  }

  toggle.addEventListener("click", function () {
    paused = !paused;
    toggle.setAttribute("aria-pressed", String(!paused));
    toggle.textContent = paused ? "Resume live view" : "Pause live view";
    if (paused) {
      if (socket) socket.close();
      status.textContent = "Paused.";
    } else {
      connect();
    }
  });

  draw(initial, true);
  connect();
})();
