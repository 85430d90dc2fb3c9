// Customer pages (portal and console): draws the server-built plotly figures, copies a new key's secret
// and shows or hides a masked one (the webhooks' signing secret).
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
        // A masked secret cannot be selected and copied by hand: show it (its button says so).
        if (input.type === "password") document.querySelector(`button[data-reveal="${input.id}"]`)?.click();
        input.select();
        if (status) status.textContent = "Select it and copy it (Ctrl+C or ⌘C).";
      }
    });
  }
}

function wireRevealButtons() {
  for (const button of document.querySelectorAll("button[data-reveal]")) {
    button.addEventListener("click", () => {
      const input = document.getElementById(button.dataset.reveal);
      const shown = input.type === "password";
      input.type = shown ? "text" : "password";
      button.textContent = shown ? "Hide" : "Show";
    });
  }
}

document.addEventListener("DOMContentLoaded", () => {
  drawFigures();
  wireCopyButtons();
  wireRevealButtons();
});
