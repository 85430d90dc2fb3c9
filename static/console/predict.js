// The small models' "try it" page: draw a digit (or edit an instance), POST it to the
// predict API as the signed-in member (X-Organization: the session's playground key), show
// the answer. No key in the page; the API checks the session and this site's Origin.
(function () {
  "use strict";
  const configElement = document.getElementById("predict-config");
  if (!configElement) return;
  const config = JSON.parse(configElement.textContent);
  const form = document.getElementById("predict-form");
  const select = document.getElementById("pd-model");
  const canvasPanel = document.getElementById("pd-canvas-panel");
  const canvas = document.getElementById("pd-canvas");
  const jsonPanel = document.getElementById("pd-json-panel");
  const textPanel = document.getElementById("pd-text-panel");
  const textBox = document.getElementById("pd-text");
  const instance = document.getElementById("pd-instance");
  const signatureText = document.getElementById("pd-signature");
  const status = document.getElementById("pd-status");
  const errorBox = document.getElementById("pd-error");
  const bars = document.getElementById("pd-probabilities");
  const out = {
    prediction: document.getElementById("pd-prediction"),
    confidence: document.getElementById("pd-confidence"),
    latency: document.getElementById("pd-latency"),
    served: document.getElementById("pd-served"),
  };
  let grid = [];
  let drawing = false;

  function model() {
    return config.models.find((m) => m.name === select.value);
  }

  function showModel() {
    const m = model();
    const canvasKind = m.tryIt && m.tryIt.kind === "canvas";
    const textKind = m.tryIt && m.tryIt.kind === "text";
    canvasPanel.hidden = !canvasKind;
    textPanel.hidden = !textKind;
    jsonPanel.hidden = canvasKind || textKind;
    textBox.value = textKind && m.example ? String(m.example[m.tryIt.input] || "") : "";
    const inputs = (m.signature.inputs || []).map((t) => `${t.name} ${t.datatype} [${t.shape.join(", ")}]`);
    signatureText.textContent = inputs.length ? `Inputs: ${inputs.join("; ")}` : "";
    instance.value = m.example ? JSON.stringify(m.example) : "{}";
    if (canvasKind) clearGrid();
    resetResult();
  }

  function resetResult() {
    for (const key of Object.keys(out)) out[key].textContent = "—";
    bars.replaceChildren();
    errorBox.hidden = true;
    status.textContent = "";
  }

  // --- the drawing grid ------------------------------------------------------------------
  function clearGrid() {
    const spec = model().tryIt;
    grid = new Array(spec.width * spec.height).fill(0);
    paint();
  }

  function paint() {
    const spec = model().tryIt;
    const ctx = canvas.getContext("2d");
    const cw = canvas.width / spec.width;
    const ch = canvas.height / spec.height;
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    for (let y = 0; y < spec.height; y++) {
      for (let x = 0; x < spec.width; x++) {
        const level = 255 - Math.round((grid[y * spec.width + x] / spec.max) * 255);
        ctx.fillStyle = `rgb(${level}, ${level}, ${level})`;
        ctx.fillRect(x * cw, y * ch, cw, ch);
        ctx.strokeStyle = "#e5e7eb";
        ctx.strokeRect(x * cw, y * ch, cw, ch);
      }
    }
  }

  function stroke(event) {
    const spec = model().tryIt;
    const rect = canvas.getBoundingClientRect();
    const fx = ((event.clientX - rect.left) / rect.width) * spec.width;
    const fy = ((event.clientY - rect.top) / rect.height) * spec.height;
    // The pen is a soft brush: the cell under it darkens most, its neighbours a little.
    for (let y = 0; y < spec.height; y++) {
      for (let x = 0; x < spec.width; x++) {
        const d = Math.hypot(x + 0.5 - fx, y + 0.5 - fy);
        if (d < 1.2) {
          const i = y * spec.width + x;
          grid[i] = Math.min(spec.max, grid[i] + (d < 0.6 ? 4 : 1.5));
        }
      }
    }
    paint();
  }

  canvas.addEventListener("pointerdown", (event) => { drawing = true; canvas.setPointerCapture(event.pointerId); stroke(event); });
  canvas.addEventListener("pointermove", (event) => { if (drawing) stroke(event); });
  canvas.addEventListener("pointerup", () => { drawing = false; });
  canvas.addEventListener("pointercancel", () => { drawing = false; });

  // --- predicting -------------------------------------------------------------------------
  function currentInstance() {
    const m = model();
    if (m.tryIt && m.tryIt.kind === "canvas") {
      return { [m.tryIt.input]: grid.map((v) => Math.round(v * 100) / 100) };
    }
    if (m.tryIt && m.tryIt.kind === "text") {
      return { [m.tryIt.input]: textBox.value };
    }
    return JSON.parse(instance.value);
  }

  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    resetResult();
    let body;
    try {
      body = { inputs: [currentInstance()] };
    } catch (err) {
      errorBox.textContent = `The instance is not valid JSON: ${err.message}`;
      errorBox.hidden = false;
      return;
    }
    status.textContent = "Predicting…";
    const started = performance.now();
    let response;
    try {
      response = await fetch(`/api/v1/models/${encodeURIComponent(select.value)}/predict`, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", "X-Organization": String(config.organization) },
        body: JSON.stringify(body),
      });
    } catch (err) {
      status.textContent = "";
      errorBox.textContent = `The request failed: ${err.message}`;
      errorBox.hidden = false;
      return;
    }
    const data = await response.json().catch(() => ({}));
    status.textContent = `HTTP ${response.status} in ${Math.round(performance.now() - started)} ms`;
    if (!response.ok) {
      errorBox.textContent = (data.error && data.error.message) || `HTTP ${response.status}`;
      errorBox.hidden = false;
      return;
    }
    const answer = data.predictions[0];
    out.prediction.textContent = answer.prediction === undefined ? "—" : String(answer.prediction);
    out.confidence.textContent = answer.confidence === undefined ? "—" : `${(answer.confidence * 100).toFixed(1)} %`;
    out.latency.textContent = `${data.latency_ms.toFixed(1)} ms`;
    out.served.textContent = `${data.model_version} · ${response.headers.get("x-cache") || "miss"}`;
    const probabilities = answer.outputs && answer.outputs.probabilities;
    if (Array.isArray(probabilities)) {
      const labels = model().labels;
      probabilities.forEach((p, i) => {
        const row = document.createElement("div");
        row.className = "pd-bar" + (String(labels[i] ?? i) === String(answer.prediction) ? " pd-top" : "");
        const name = document.createElement("span");
        name.textContent = labels[i] ?? String(i);
        const track = document.createElement("span");
        const fill = document.createElement("span");
        fill.className = "pd-fill";
        fill.style.display = "block";
        fill.style.width = `${Math.max(0, Math.min(1, p)) * 100}%`;
        track.append(fill);
        const value = document.createElement("span");
        value.textContent = `${(p * 100).toFixed(1)} %`;
        row.append(name, track, value);
        bars.append(row);
      });
    }
  });

  document.getElementById("pd-clear").addEventListener("click", () => {
    const m = model();
    if (m.tryIt && m.tryIt.kind === "canvas") clearGrid();
    else if (m.tryIt && m.tryIt.kind === "text") textBox.value = "";
    else instance.value = m.example ? JSON.stringify(m.example) : "{}";
    resetResult();
  });
  select.addEventListener("change", showModel);
  showModel();
})();
