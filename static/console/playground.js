// The playground: one WebSocket to the platform's chat API, signed in by the page's session
// (an "auth" frame naming the organisation), one or two columns streaming at once.
"use strict";

(() => {
  const config = JSON.parse(document.getElementById("playground-config").textContent);
  const form = document.getElementById("playground-form");
  const sendButton = document.getElementById("pg-send");
  const stopButton = document.getElementById("pg-stop");
  const compare = document.getElementById("pg-compare");
  const connection = document.getElementById("pg-connection");
  const formError = document.getElementById("pg-form-error");
  const columns = Array.from(document.querySelectorAll(".pg-column"));
  const modelsByName = new Map(config.models.map((m) => [m.name, m]));

  let socket = null;
  let opening = null; // a Promise of an authenticated socket
  let counter = 0;
  const runs = new Map(); // request id -> run

  function field(column, name) {
    return column.querySelector(`[data-field="${name}"]`);
  }

  // --- pickers ------------------------------------------------------------------------

  function fillVersions(column) {
    const model = modelsByName.get(column.querySelector("[data-role=model]").value);
    const select = column.querySelector("[data-role=version]");
    select.replaceChildren(new Option("Routed (traffic split)", ""));
    for (const version of model ? model.versions : []) {
      const live = model.weighted.includes(version);
      select.append(new Option(`${version}${live ? "" : " (pinned only)"}`, version));
    }
  }

  for (const column of columns) {
    column.querySelector("[data-role=model]").addEventListener("change", () => fillVersions(column));
    fillVersions(column);
  }
  // The second column starts on another model (or, with one model, on another version).
  const second = columns[1];
  if (config.models.length > 1) {
    second.querySelector("[data-role=model]").value = config.models[1].name;
    fillVersions(second);
  } else if (config.models.length === 1 && config.models[0].versions.length > 1) {
    second.querySelector("[data-role=version]").value = config.models[0].versions[1];
  }

  compare.addEventListener("change", () => {
    second.hidden = !compare.checked;
    document.getElementById("pg-columns").classList.toggle("pg-compare", compare.checked);
  });

  // --- the socket ---------------------------------------------------------------------

  function setConnection(text) {
    connection.textContent = text;
  }

  function openSocket() {
    if (opening) return opening;
    opening = new Promise((resolve, reject) => {
      const scheme = window.location.protocol === "https:" ? "wss:" : "ws:";
      const ws = new WebSocket(`${scheme}//${window.location.host}${config.socketPath}`);
      let authenticated = false;
      setConnection("Connecting…");
      ws.addEventListener("open", () => {
        ws.send(JSON.stringify({ type: "auth", organization: config.organization }));
      });
      ws.addEventListener("message", (event) => {
        const frame = JSON.parse(event.data);
        if (frame.type === "auth") {
          if (frame.ok) {
            authenticated = true;
            socket = ws;
            setConnection("Connected");
            resolve(ws);
          } else {
            reject(new Error(describe(frame.error)));
            ws.close();
          }
          return;
        }
        onFrame(frame);
      });
      ws.addEventListener("close", () => {
        socket = null;
        opening = null;
        setConnection("Not connected");
        if (!authenticated) reject(new Error("Could not open the connection to the API."));
        for (const run of runs.values()) {
          if (!run.done) finish(run, "disconnected", "The connection to the API was closed.");
        }
      });
    });
    opening.catch(() => {
      opening = null;
    });
    return opening;
  }

  // --- runs ---------------------------------------------------------------------------

  function describe(error) {
    if (!error) return "Unknown error.";
    return error.code ? `${error.message} (${error.code})` : error.message;
  }

  function readout(run) {
    field(run.column, "tokens").textContent = String(run.tokens);
    if (run.firstAt !== null) {
      field(run.column, "ttft").textContent = `${Math.round(run.firstAt - run.startedAt)} ms`;
      const seconds = (performance.now() - run.firstAt) / 1000;
      if (run.tokens > 1 && seconds > 0) {
        field(run.column, "rate").textContent = ((run.tokens - 1) / seconds).toFixed(1);
      }
    }
  }

  function running() {
    return Array.from(runs.values()).filter((run) => !run.done);
  }

  function updateButtons() {
    const busy = running().length > 0;
    sendButton.disabled = busy;
    stopButton.disabled = !busy;
  }

  function finish(run, status, error) {
    run.done = true;
    field(run.column, "status").textContent = status;
    run.column.dataset.state = status;
    if (error) {
      const box = field(run.column, "error");
      box.textContent = error;
      box.hidden = false;
    }
    updateButtons();
  }

  function onFrame(frame) {
    const run = runs.get(frame.id);
    if (!run) {
      if (frame.type === "error") showFormError(describe(frame.error));
      return;
    }
    if (frame.type === "chunk") {
      for (const choice of frame.data.choices || []) {
        const text = choice.delta && choice.delta.content;
        if (!text) continue;
        if (run.firstAt === null) {
          run.firstAt = performance.now();
          field(run.column, "status").textContent = "streaming";
        }
        run.tokens += 1; // one token a chunk, as vLLM streams; the usage frame has the exact count
        field(run.column, "output").append(text);
      }
      readout(run);
    } else if (frame.type === "error") {
      // Before admission this is the request's last frame; after, a usage frame follows.
      finish(run, "error", describe(frame.error));
    } else if (frame.type === "usage") {
      run.tokens = frame.usage.completion_tokens;
      readout(run);
      run.column.dataset.requestId = frame.request_id;
      const cached = frame.cache && frame.cache !== "miss" ? ` · answered from the cache (${frame.cache})` : "";
      field(run.column, "served").textContent =
        `Version ${frame.model_version} · ${frame.usage.prompt_tokens} prompt + ` +
        `${frame.usage.completion_tokens} completion tokens${cached} · request ${frame.request_id}`;
      const status = frame.status === "completed" ? "completed" : `${frame.status} (${frame.status_code})`;
      run.done = false;
      finish(run, status, null);
      runs.delete(frame.id);
    }
  }

  function showFormError(text) {
    formError.textContent = text;
    formError.hidden = !text;
  }

  function settings() {
    const message = form.elements.message.value.trim();
    const temperature = Number(form.elements.temperature.value);
    const maxTokens = Number(form.elements.max_tokens.value);
    if (!message) return { error: "Write a message first.", focus: form.elements.message };
    if (!(temperature >= 0 && temperature <= 2)) {
      return { error: "Temperature must be between 0 and 2.", focus: form.elements.temperature };
    }
    if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > Number(form.elements.max_tokens.max)) {
      return { error: `Max tokens must be a whole number from 1 to ${form.elements.max_tokens.max}.`,
               focus: form.elements.max_tokens };
    }
    const messages = [];
    const system = form.elements.system.value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: message });
    return { messages, temperature, maxTokens };
  }

  async function send(event) {
    event.preventDefault();
    if (running().length > 0) return;
    const chosen = settings();
    if (chosen.error) {
      showFormError(chosen.error);
      chosen.focus.focus();
      return;
    }
    showFormError("");
    for (const [id, run] of runs) if (run.done) runs.delete(id); // late frames of old runs are ignored
    const active = columns.filter((column) => !column.hidden);
    for (const column of active) {
      field(column, "output").textContent = "";
      field(column, "error").hidden = true;
      field(column, "served").textContent = "";
      field(column, "tokens").textContent = "0";
      field(column, "ttft").textContent = "–";
      field(column, "rate").textContent = "–";
      field(column, "status").textContent = "connecting";
      column.dataset.state = "running";
      delete column.dataset.requestId;
    }
    sendButton.disabled = true;
    let ws;
    try {
      ws = await openSocket();
    } catch (error) {
      for (const column of active) {
        field(column, "status").textContent = "error";
        column.dataset.state = "error";
      }
      showFormError(error.message);
      sendButton.disabled = false;
      return;
    }
    for (const column of active) {
      counter += 1;
      const id = `${column.dataset.column}-${counter}`;
      const run = { id, column, startedAt: performance.now(), firstAt: null, tokens: 0, done: false };
      runs.set(id, run);
      column.dataset.runId = id;
      const frame = {
        type: "chat.completion",
        id,
        body: {
          model: column.querySelector("[data-role=model]").value,
          messages: chosen.messages,
          temperature: chosen.temperature,
          max_tokens: chosen.maxTokens,
        },
      };
      if (!form.elements.cache.checked) frame.body.cache = false; // always ask the engine
      const version = column.querySelector("[data-role=version]").value;
      if (version) frame.model_version = version;
      field(column, "status").textContent = "waiting for the first token";
      ws.send(JSON.stringify(frame));
    }
    updateButtons();
  }

  function stop() {
    if (!socket) return;
    for (const run of running()) {
      socket.send(JSON.stringify({ type: "cancel", id: run.id }));
      field(run.column, "status").textContent = "stopping";
    }
  }

  form.addEventListener("submit", send);
  stopButton.addEventListener("click", stop);
  form.elements.message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
  });
})();
