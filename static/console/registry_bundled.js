// The bundled models' import: while a run is queued or running, poll its state (kept by the
// Celery task) every two seconds and show its progress lines; reload once it ends, so the
// table shows what was registered.
"use strict";

(function () {
  const box = document.getElementById("import-state");
  if (!box) return;
  const label = document.getElementById("import-state-label");
  const bar = document.getElementById("import-progress");
  const log = document.getElementById("import-log");
  const error = document.getElementById("import-error");
  const button = document.getElementById("import-start");
  if (box.dataset.active !== "1") return;

  function show(state) {
    label.textContent = state.state;
    box.dataset.state = state.state;
    log.hidden = !state.lines.length;
    log.textContent = state.lines.join("\n");
    log.scrollTop = log.scrollHeight;
    error.hidden = !state.error;
    error.textContent = state.error || "";
  }

  function poll() {
    fetch(box.dataset.url, { headers: { Accept: "application/json" }, credentials: "same-origin" })
      .then(function (response) { return response.json(); })
      .then(function (state) {
        show(state);
        if (state.active) {
          window.setTimeout(poll, 2000);
        } else {
          bar.hidden = true;
          button.disabled = false;
          window.location.reload();
        }
      })
      .catch(function () { window.setTimeout(poll, 5000); });
  }
  window.setTimeout(poll, 1000);
})();
