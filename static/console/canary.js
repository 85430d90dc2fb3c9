// The canary page: draws the comparison charts, and polls the canary's state so that a new
// decision (or a pause, promotion, rollback) appears without a manual reload.
"use strict";

function drawCharts(root) {
  root.querySelectorAll("[data-chart]").forEach((node) => {
    const data = document.getElementById(node.dataset.chart);
    if (!data || typeof Plotly === "undefined") {
      return;
    }
    const figure = JSON.parse(data.textContent);
    Plotly.newPlot(node, figure.data, figure.layout, { responsive: true, displaylogo: false });
  });
}

const live = document.getElementById("canary-live");
if (live) {
  drawCharts(live);
  const POLL_MS = 3000;
  let busy = false;
  window.setInterval(async () => {
    if (busy || document.hidden) {
      return;
    }
    busy = true;
    try {
      const stateResponse = await fetch(live.dataset.stateUrl, { headers: { Accept: "application/json" } });
      const current = live.querySelector("[data-stamp]");
      if (stateResponse.ok && current) {
        const state = await stateResponse.json();
        if (state.stamp !== current.dataset.stamp) {
          const fragment = await fetch(live.dataset.fragmentUrl);
          if (fragment.ok) {
            live.innerHTML = await fragment.text();
            drawCharts(live);
          }
        }
      }
    } catch (error) {
      // A missed poll is retried at the next tick.
    } finally {
      busy = false;
    }
  }, POLL_MS);
}
