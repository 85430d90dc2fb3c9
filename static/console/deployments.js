// The deployments page: the traffic split editor's live sum, and hot-swaps followed while under way.
"use strict";

function updateSum(editor) {
  const inputs = editor.querySelectorAll("input[data-weight]");
  let sum = 0;
  let whole = true;
  inputs.forEach((input) => {
    const value = input.value.trim();
    if (value === "" || !/^\d+$/.test(value)) {
      whole = whole && value === "";
      return;
    }
    sum += Number(value);
  });
  const output = editor.querySelector("[data-split-sum]");
  output.textContent = whole ? String(sum) : `${sum} (not whole numbers)`;
  const line = output.closest(".split-sum");
  line.classList.toggle("good", whole && sum === 100);
  line.classList.toggle("bad", !whole || sum !== 100);
}

document.querySelectorAll("[data-split-editor]").forEach((editor) => {
  editor.addEventListener("input", () => updateSum(editor));
  updateSum(editor);
});

const PHASES = ["starting", "shifted", "draining", "completed"];

function showPhase(box, phase) {
  box.querySelector("[data-swap-phase]").textContent = phase;
  const at = PHASES.indexOf(phase);
  box.querySelectorAll(".phases li").forEach((item) => {
    const index = PHASES.indexOf(item.dataset.phase);
    item.classList.toggle("done", at >= 0 && index < at);
    item.classList.toggle("current", index === at);
  });
}

function followSwap(box) {
  showPhase(box, box.querySelector("[data-swap-phase]").textContent.trim());
  if (box.dataset.swapOpen !== "true") {
    return;
  }
  const timer = window.setInterval(async () => {
    try {
      const response = await fetch(box.dataset.swapUrl, { headers: { Accept: "application/json" } });
      if (!response.ok) {
        return;
      }
      const swap = await response.json();
      showPhase(box, swap.phase);
      if (!swap.open) {
        window.clearInterval(timer);
        window.location.reload(); // the deployments changed: show them as they are now
      }
    } catch (error) {
      // A missed poll is retried at the next tick.
    }
  }, 2000);
}

document.querySelectorAll("[data-swap-id]").forEach(followSwap);

// The live table: its figures polled every 5 seconds while the page is shown (the same cells
// the server rendered, from console/deployments/live/).
const LIVE_EVERY_MS = 5000;
const liveRows = [...document.querySelectorAll("table.live tr[data-deployment]")];
const liveUrl = document.querySelector("[data-live-url]")?.dataset.liveUrl;

async function refreshLive() {
  if (document.hidden || !liveRows.length || !liveUrl) {
    return;
  }
  const ids = liveRows.map((row) => row.dataset.deployment).join(",");
  try {
    const response = await fetch(`${liveUrl}?ids=${ids}`, { headers: { Accept: "application/json" } });
    if (!response.ok) {
      return;
    }
    const { deployments } = await response.json();
    liveRows.forEach((row) => {
      const cells = deployments[row.dataset.deployment];
      if (!cells) {
        return;
      }
      row.querySelectorAll("[data-live]").forEach((cell) => {
        const value = cells[cell.dataset.live];
        if (value !== undefined && cell.textContent !== value) {
          cell.textContent = value;
        }
      });
      const status = row.querySelector("[data-live=status]");
      if (status) {
        status.className = `status status-${cells.state}`;
      }
      const rate = row.querySelector("[data-live=rate]");
      if (rate) {
        rate.title = `${cells.requests} request${String(cells.requests) === "1" ? "" : "s"}`;
      }
    });
  } catch (error) {
    // A missed poll is retried at the next tick.
  }
}

if (liveRows.length) {
  window.setInterval(refreshLive, LIVE_EVERY_MS);
}
