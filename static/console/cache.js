// The cache page's hit-rate chart, drawn from the figure the server built from the hourly rollups.
"use strict";

(function () {
  const data = document.getElementById("cache-hit-rate-figure");
  const element = document.getElementById("cache-hit-rate-chart");
  if (!data || !element || typeof Plotly === "undefined") return;
  const figure = JSON.parse(data.textContent);
  Plotly.newPlot(element, figure.data, figure.layout, { responsive: true, displaylogo: false });
})();
