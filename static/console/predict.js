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
  const featuresPanel = document.getElementById("pd-features-panel");
  const featuresBox = document.getElementById("pd-features");
  const csvPanel = document.getElementById("pd-csv-panel");
  const csvInput = document.getElementById("pd-csv");
  const rowsBox = document.getElementById("pd-rows");
  const priceText = document.getElementById("pd-price");
  const code = {
    curl: document.getElementById("pd-code-curl"),
    python: document.getElementById("pd-code-python"),
    triton: document.getElementById("pd-code-triton"),
  };
  const MAX_FIELDS = 64;
  const MAX_CSV_ROWS = 256;
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

  // A tabular model (one input of [-1, n] numbers, n small): a labelled field per feature.
  function tabular(m) {
    const inputs = m.signature.inputs || [];
    if (m.tryIt || inputs.length !== 1) return null;
    const shape = inputs[0].shape || [];
    const width = shape.length === 2 ? shape[1] : -1;
    if (width < 1 || width > MAX_FIELDS || !/^(FP|INT|UINT)/.test(inputs[0].datatype)) return null;
    return { name: inputs[0].name, width };
  }

  function showFeatures(m) {
    const table = tabular(m);
    featuresPanel.hidden = !table;
    csvPanel.hidden = !table;
    featuresBox.replaceChildren();
    if (!table) return;
    const example = (m.example && m.example[table.name]) || [];
    for (let i = 0; i < table.width; i++) {
      const label = document.createElement("label");
      const name = (m.featureNames && m.featureNames[i]) || `${table.name}[${i}]`;
      const input = document.createElement("input");
      input.type = "number";
      input.step = "any";
      input.required = true;
      input.dataset.feature = String(i);
      input.value = example[i] === undefined ? "" : String(example[i]);
      input.addEventListener("input", () => {
        try {
          instance.value = JSON.stringify(currentInstance());
        } catch {
          return; // a field being typed (or emptied): Predict explains it
        }
        showCode();
      });
      label.append(name, input);
      featuresBox.append(label);
    }
  }

  function showModel() {
    const m = model();
    const canvasKind = m.tryIt && m.tryIt.kind === "canvas";
    const textKind = m.tryIt && m.tryIt.kind === "text";
    canvasPanel.hidden = !canvasKind;
    textPanel.hidden = !textKind;
    jsonPanel.hidden = canvasKind || textKind;
    jsonPanel.open = !tabular(m) && !canvasKind && !textKind;
    textBox.value = textKind && m.example ? String(m.example[m.tryIt.input] || "") : "";
    const inputs = (m.signature.inputs || []).map((t) => `${t.name} ${t.datatype} [${t.shape.join(", ")}]`);
    signatureText.textContent = inputs.length ? `Inputs: ${inputs.join("; ")}` : "";
    instance.value = m.example ? JSON.stringify(m.example) : "{}";
    priceText.textContent = m.pricePer1k ? `Priced ${m.pricePer1k} per 1,000 inferences.` : "No price is set for this model.";
    showFeatures(m);
    if (canvasKind) clearGrid();
    resetResult();
    showCode();
  }

  // --- the code for this request -----------------------------------------------------------
  function showCode() {
    const m = model();
    let row;
    try {
      row = currentInstance();
    } catch {
      row = m.example || {};
    }
    const body = JSON.stringify({ inputs: [row] });
    const url = `${config.baseUrl}/api/v1/models/${m.name}/predict`;
    code.curl.textContent = `curl ${url} \\\n  -H "Authorization: Bearer $OPENAI_API_KEY" \\\n  -H "Content-Type: application/json" \\\n  -d '${body.replace(/'/g, "'\\''")}'`;
    code.python.textContent = [
      "import os", "", "import requests", "",
      "response = requests.post(",
      `    "${url}",`,
      '    headers={"Authorization": f"Bearer {os.environ[\'OPENAI_API_KEY\']}"},',
      `    json=${body},`,
      "    timeout=30,",
      ")",
      "response.raise_for_status()",
      'print(response.json()["predictions"][0])',
    ].join("\n");
    const table = tabular(m);
    const input = (m.signature.inputs || [])[0];
    if (!input) { code.triton.textContent = ""; return; }
    const values = row[input.name];
    const flat = Array.isArray(values) ? values : [values];
    const numpyType = input.datatype === "BYTES" ? "object" : "np." + input.datatype.toLowerCase().replace("fp", "float");
    const host = config.baseUrl.replace(/^https?:\/\//, "").replace(/\/.*$/, "");
    code.triton.textContent = [
      "import os", "", "import numpy as np", "import tritonclient.http as httpclient", "",
      'headers = {"Authorization": f"Bearer {os.environ[\'OPENAI_API_KEY\']}"}',
      `client = httpclient.InferenceServerClient("${host}"${config.baseUrl.startsWith("https:") ? ", ssl=True" : ""})`,
      `rows = np.array([${JSON.stringify(flat)}], dtype=${numpyType})`,
      `tensor = httpclient.InferInput("${input.name}", list(rows.shape), "${input.datatype}")`,
      "tensor.set_data_from_numpy(rows)",
      `result = client.infer("${m.name}", [tensor], headers=headers)`,
      (m.signature.outputs || []).length
        ? `print(${(m.signature.outputs || []).map((o) => `result.as_numpy("${o.name}")`).join(", ")})`
        : "print(result.get_response())",
    ].join("\n");
    if (!table && !Array.isArray(values)) code.triton.textContent = code.triton.textContent.replace(`[${JSON.stringify(flat)}]`, JSON.stringify(flat));
  }

  function resetResult() {
    for (const key of Object.keys(out)) out[key].textContent = "—";
    bars.replaceChildren();
    rowsBox.hidden = true;
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
    const table = tabular(m);
    if (table && !jsonPanel.open) {
      const values = [...featuresBox.querySelectorAll("input")].map((input) => {
        if (input.value.trim() === "" || !Number.isFinite(Number(input.value))) {
          throw new Error(`${input.parentElement.firstChild.textContent} needs a number`);
        }
        return Number(input.value);
      });
      return { [table.name]: values };
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
      errorBox.textContent = err instanceof SyntaxError ? `The instance is not valid JSON: ${err.message}` : err.message;
      errorBox.hidden = false;
      return;
    }
    showCode();
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

  // --- a CSV file: every row an instance, one request, a table of answers -------------------
  function csvRows(text, width) {
    const rows = [];
    for (const line of text.split(/\r?\n/)) {
      if (!line.trim()) continue;
      const cells = line.split(",").map((c) => c.trim().replace(/^"(.*)"$/, "$1"));
      const numbers = cells.map(Number);
      if (rows.length === 0 && numbers.some((n, i) => cells[i] === "" || !Number.isFinite(n))) continue; // a header
      if (numbers.length !== width || numbers.some((n) => !Number.isFinite(n))) {
        throw new Error(`Row ${rows.length + 1} has ${cells.length} values; the model takes ${width} numbers a row.`);
      }
      rows.push(numbers);
      if (rows.length > MAX_CSV_ROWS) throw new Error(`More than ${MAX_CSV_ROWS} rows: split the file.`);
    }
    if (!rows.length) throw new Error("The file has no rows of numbers.");
    return rows;
  }

  csvInput.addEventListener("change", async () => {
    const file = csvInput.files[0];
    if (!file) return;
    resetResult();
    const m = model();
    const table = tabular(m);
    let rows;
    try {
      rows = csvRows(await file.text(), table.width);
    } catch (err) {
      errorBox.textContent = err.message;
      errorBox.hidden = false;
      return;
    }
    status.textContent = `Predicting ${rows.length} row${rows.length === 1 ? "" : "s"}…`;
    const response = await fetch(`/api/v1/models/${encodeURIComponent(m.name)}/predict`, {
      method: "POST",
      credentials: "same-origin",
      headers: { "Content-Type": "application/json", "X-Organization": String(config.organization) },
      body: JSON.stringify({ inputs: rows.map((r) => ({ [table.name]: r })) }),
    }).catch((err) => ({ ok: false, status: 0, json: async () => ({ error: { message: err.message } }) }));
    const data = await response.json().catch(() => ({}));
    status.textContent = `HTTP ${response.status}`;
    if (!response.ok) {
      errorBox.textContent = (data.error && data.error.message) || `HTTP ${response.status}`;
      errorBox.hidden = false;
      return;
    }
    const body = rowsBox.querySelector("tbody");
    body.replaceChildren(...data.predictions.map((answer, i) => {
      const tr = document.createElement("tr");
      for (const [text, numeric] of [[String(i + 1), true], [answer.prediction === undefined ? "—" : String(answer.prediction), false],
        [answer.confidence === undefined ? "—" : `${(answer.confidence * 100).toFixed(1)} %`, true]]) {
        const td = document.createElement("td");
        td.textContent = text;
        if (numeric) td.className = "num";
        tr.append(td);
      }
      return tr;
    }));
    rowsBox.hidden = false;
    out.latency.textContent = `${data.latency_ms.toFixed(1)} ms for ${rows.length} row${rows.length === 1 ? "" : "s"}`;
    out.served.textContent = `${data.model_version} · ${response.headers.get("x-cache") || "miss"}`;
    csvInput.value = "";
  });

  document.getElementById("pd-clear").addEventListener("click", () => {
    const m = model();
    if (m.tryIt && m.tryIt.kind === "canvas") clearGrid();
    else if (m.tryIt && m.tryIt.kind === "text") textBox.value = "";
    else {
      instance.value = m.example ? JSON.stringify(m.example) : "{}";
      showFeatures(m);
    }
    resetResult();
  });
  select.addEventListener("change", showModel);
  showModel();
})();
