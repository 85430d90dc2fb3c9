// Customer pages (portal and console): draws the server-built plotly figures and copies a new key's secret.
"use strict";

function drawFigures() {
  if (typeof Plotly === "undefined") return;
  for (const element of document.querySelectorAll("[data-figure]")) {
    const source = document.getElementById(`figure-${element.dataset.figure}`);
    if (!source) continue;
    const figure = JSON.parse(source.textContent);
    Plotly.newPlot(element, figure.data, figure.layout, { responsive: true, displaylogo: false });
  }
}

function wireCopyButtons() {
  for (const button of document.querySelectorAll("button[data-copy]")) {
    button.addEventListener("click", async () => {
      const input = document.getElementById(button.dataset.copy);
      const status = document.getElementById("copy-status");
      input.select();
      try {
        await navigator.clipboard.writeText(input.value);
        if (status) status.textContent = "Copied to the clipboard.";
      } catch {
        if (status) status.textContent = "Select the key and copy it (Ctrl+C or ⌘C).";
      }
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  drawFigures();
  wireCopyButtons();
});
