// The playground: one WebSocket to the platform's chat API, signed in by the page's session
// (an "auth" frame naming the organisation), one or two columns streaming at once. Each column
// keeps its own conversation (the user turns are shared, the answers its own) and sends it
// whole with the next message; "View code" shows the same request as curl, Python and a
// WebSocket frame, built by the same function that builds what Send sends.
"use strict";

(() => {
  const config = JSON.parse(document.getElementById("playground-config").textContent);
  const form = document.getElementById("playground-form");
  const sendButton = document.getElementById("pg-send");
  const stopButton = document.getElementById("pg-stop");
  const newButton = document.getElementById("pg-new");
  const codeButton = document.getElementById("pg-view-code");
  const compare = document.getElementById("pg-compare");
  const connection = document.getElementById("pg-connection");
  const formError = document.getElementById("pg-form-error");
  const cacheBox = document.getElementById("pg-cache");
  const cacheHint = document.getElementById("pg-cache-hint");
  const columnsBox = document.getElementById("pg-columns");
  const modelsByName = new Map(config.models.map((m) => [m.name, m]));

  const columns = Array.from(document.querySelectorAll(".pg-column")).map((el) => {
    const letter = el.dataset.column;
    return {
      letter,
      el,
      model: document.getElementById(`pg-model-${letter}`),
      version: document.getElementById(`pg-version-${letter}`),
      pickers: form.querySelector(`[data-pickers="${letter}"]`),
      turns: [], // {role, content, left, node, text, who}: the conversation as this column sent it
      lastSent: null, // {frame, at}: the last request's frame, exactly as sent
      outcome: { words: "idle", code: "", requestId: "" },
    };
  });
  const second = columns[1];

  let socket = null;
  let opening = null; // a Promise of an authenticated socket
  let counter = 0;
  let cacheWanted = cacheBox.checked; // the member's choice, kept while the option cannot apply
  const runs = new Map(); // request id -> run

  function field(el, name) {
    return el.querySelector(`[data-field="${name}"]`);
  }

  function active() {
    return compare.checked ? columns : [columns[0]];
  }

  // --- pickers ------------------------------------------------------------------------

  function fillVersions(column) {
    const model = modelsByName.get(column.model.value);
    column.version.replaceChildren(new Option("Routed (traffic split)", ""));
    for (const version of model ? model.versions : []) {
      const live = model.weighted.includes(version);
      column.version.append(new Option(`${version}${live ? "" : " (pinned only)"}`, version));
    }
  }

  function showTitle(column) {
    const version = column.version.value;
    field(column.el, "title").textContent =
      `${column.model.value} · ${version ? `version ${version}` : "routed"}`;
  }

  for (const column of columns) {
    column.model.addEventListener("change", () => {
      fillVersions(column);
      showTitle(column);
      updateCache();
    });
    column.version.addEventListener("change", () => showTitle(column));
    fillVersions(column);
  }
  // A link may name the model and version to try (?model=…&version=…, checked by the server).
  if (config.initial && config.initial.model) {
    columns[0].model.value = config.initial.model;
    fillVersions(columns[0]);
    columns[0].version.value = config.initial.version || "";
  }
  // The second column starts on another model (or, with one model, on another version).
  if (config.models.length > 1) {
    second.model.value = config.models[1].name;
    fillVersions(second);
  } else if (config.models.length === 1 && config.models[0].versions.length > 1) {
    second.version.value = config.models[0].versions[1];
  }
  columns.forEach(showTitle);

  function showCompare() {
    second.el.hidden = !compare.checked;
    second.pickers.hidden = !compare.checked;
    form.classList.toggle("pg-comparing", compare.checked);
    columnsBox.classList.toggle("pg-compare", compare.checked);
    columnsBox.classList.toggle("pg-comparing", compare.checked);
    updateCache();
  }
  compare.addEventListener("change", showCompare);

  // --- the cache option: the gateway's rules (config.models[].cache), said in words ----

  function cacheReason(column) {
    const model = modelsByName.get(column.model.value);
    if (!model) return "";
    const terms = model.cache;
    if (terms.off) return terms.off;
    const raw = form.elements.temperature.value;
    const temperature = Number(raw);
    if (raw !== "" && temperature > terms.maxTemperature) {
      return `Not at temperature ${temperature}: ${model.name}'s cache answers at ${terms.maxTemperature} or below.`;
    }
    return "";
  }

  function cacheTerms(column) {
    const terms = modelsByName.get(column.model.value).cache;
    return `at temperature ${terms.maxTemperature} or below, for prompts up to ` +
      `${terms.maxPromptTokens.toLocaleString("en-US")} tokens`;
  }

  function updateCache() {
    const shown = active();
    const reasons = shown.map((column) => cacheReason(column));
    const off = reasons.every(Boolean);
    cacheBox.disabled = off;
    cacheBox.checked = off ? false : cacheWanted;
    cacheBox.closest(".pg-cache").classList.toggle("pg-disabled", off);
    const each = (say) => shown.map((column, i) => `${column.letter.toUpperCase()}: ${say(column, i)}`).join(" ");
    let text;
    if (off) {
      text = new Set(reasons).size === 1 ? reasons[0] : each((_, i) => reasons[i]);
    } else if (reasons.some(Boolean)) {
      text = each((column, i) => reasons[i] || `the cache answers ${cacheTerms(column)}.`);
    } else {
      const terms = new Set(shown.map(cacheTerms));
      text = terms.size === 1
        ? `The cache answers ${[...terms][0]}, as the API does.`
        : each((column) => `${cacheTerms(column)}.`);
    }
    cacheHint.textContent = text;
  }

  cacheBox.addEventListener("change", () => {
    cacheWanted = cacheBox.checked;
  });
  form.elements.temperature.addEventListener("input", updateCache);

  // --- the conversation ---------------------------------------------------------------

  function addTurn(column, role, content, label) {
    field(column.el, "empty").hidden = true;
    const node = document.createElement("article");
    node.className = `pg-turn pg-${role}`;
    const who = document.createElement("h3");
    who.className = "pg-who";
    who.textContent = label;
    const text = document.createElement("div");
    text.className = "pg-text";
    text.textContent = content;
    node.append(who, text);
    field(column.el, "output").append(node);
    const turn = { role, content, left: false, node, text, who, label, notes: [] };
    column.turns.push(turn);
    return turn;
  }

  function note(turn, words) {
    turn.notes.push(words);
    turn.who.textContent = [turn.label, ...turn.notes].join(" · ");
  }

  function relabel(turn, label) {
    turn.label = label;
    turn.who.textContent = [turn.label, ...turn.notes].join(" · ");
  }

  function leaveOut(turn, why) {
    // Shown still, never sent again: a turn without an answer would leave the conversation
    // with two user turns in a row.
    turn.left = true;
    turn.node.classList.add("pg-left");
    note(turn, why);
  }

  function scrollDown(column) {
    const output = field(column.el, "output");
    output.scrollTop = output.scrollHeight;
  }

  function clearReadout(column) {
    field(column.el, "served").textContent = "";
    field(column.el, "tokens").textContent = "0";
    field(column.el, "ttft").textContent = "–";
    field(column.el, "rate").textContent = "–";
    delete column.el.dataset.requestId;
    delete column.el.dataset.promptTokens;
    delete column.el.dataset.completionTokens;
  }

  function newConversation() {
    if (running().length > 0) return;
    for (const column of columns) {
      column.turns = [];
      column.lastSent = null;
      const output = field(column.el, "output");
      output.replaceChildren(field(column.el, "empty"));
      field(column.el, "empty").hidden = false;
      clearReadout(column);
      setStatus(column, "idle", "");
      column.el.dataset.state = "idle";
    }
    showFormError("");
    form.elements.message.focus();
  }

  // --- what is sent: one builder for Send and for "View code" -------------------------

  function settings({ forCode = false } = {}) {
    const message = form.elements.message.value.trim();
    const temperature = Number(form.elements.temperature.value);
    const maxTokens = Number(form.elements.max_tokens.value);
    if (!message && !forCode) return { error: "Write a message first.", focus: form.elements.message };
    if (!(form.elements.temperature.value !== "" && temperature >= 0 && temperature <= 2)) {
      return { error: "Temperature must be between 0 and 2.", focus: form.elements.temperature };
    }
    if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > Number(form.elements.max_tokens.max)) {
      return { error: `Max tokens must be a whole number from 1 to ${form.elements.max_tokens.max}.`,
               focus: form.elements.max_tokens };
    }
    return { message, system: form.elements.system.value.trim(), temperature, maxTokens };
  }

  function frameFor(column, chosen, id, message) {
    const messages = [];
    if (chosen.system) messages.push({ role: "system", content: chosen.system });
    for (const turn of column.turns) {
      if (!turn.left) messages.push({ role: turn.role, content: turn.content });
    }
    messages.push({ role: "user", content: message });
    const frame = { type: "chat.completion", id };
    const version = column.version.value;
    if (version) frame.model_version = version; // as X-Model-Version on REST
    frame.body = {
      model: column.model.value,
      messages,
      temperature: chosen.temperature,
      max_tokens: chosen.maxTokens,
    };
    // Only where the cache could answer: elsewhere the gateway never uses it anyway.
    if (!cacheReason(column) && !cacheBox.checked) frame.body.cache = false; // always ask the engine
    return frame;
  }

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
          if (!run.done) end(run, "error", "", "The connection to the API was closed.");
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

  function setStatus(column, words, code, requestId = "") {
    column.outcome = { words, code: code ? String(code) : "", requestId };
    field(column.el, "status").textContent = words;
    field(column.el, "status-code").textContent = code ? `HTTP ${code}` : "";
  }

  // How a request ended, in words: the usage frame's status and the last chunk's finish_reason.
  function outcomeWords(run, status) {
    if (status === "cancelled") return "stopped by you";
    if (status === "error") return `error: ${run.error || "the request failed."}`;
    if (run.finishReason === "length") return "cut off at max tokens";
    if (run.finishReason) return `done (${run.finishReason})`;
    return "done";
  }

  function readout(run) {
    const el = run.column.el;
    field(el, "tokens").textContent = String(run.tokens);
    if (run.firstAt !== null) {
      field(el, "ttft").textContent = `${Math.round(run.firstAt - run.startedAt)} ms`;
      const seconds = (performance.now() - run.firstAt) / 1000;
      if (run.tokens > 1 && seconds > 0) {
        field(el, "rate").textContent = ((run.tokens - 1) / seconds).toFixed(1);
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
    newButton.disabled = busy;
    compare.disabled = busy;
  }

  // A run's end: "completed", "cancelled" or "error" (the usage frame's words), its HTTP
  // status when it was admitted, and what went wrong.
  function end(run, status, code, error) {
    if (error) run.error = error;
    const { column } = run;
    const words = outcomeWords(run, status);
    setStatus(column, words, code, run.requestId || "");
    column.el.dataset.state = status;
    if (!run.done) {
      run.done = true;
      const answered = run.assistant.content.length > 0;
      if (status === "error" || !answered) {
        leaveOut(run.user, "not sent again");
        leaveOut(run.assistant, status === "error" ? "failed, not sent again" : "no answer");
      } else if (status === "cancelled") {
        note(run.assistant, "stopped by you");
      } else if (run.finishReason === "length") {
        note(run.assistant, "cut off at max tokens");
      }
      run.assistant.node.classList.remove("pg-streaming");
    } else if (status === "error" && !run.user.left) {
      leaveOut(run.user, "not sent again");
      leaveOut(run.assistant, "failed, not sent again");
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
        if (choice.finish_reason) run.finishReason = choice.finish_reason;
        const text = choice.delta && choice.delta.content;
        if (!text) continue;
        if (run.firstAt === null) {
          run.firstAt = performance.now();
          setStatus(run.column, "streaming", "");
        }
        run.tokens += 1; // one token a chunk, as vLLM streams; the usage frame has the exact count
        run.assistant.content += text;
        run.assistant.text.append(text);
      }
      readout(run);
      scrollDown(run.column);
    } else if (frame.type === "error") {
      // Before admission this is the request's last frame; after, a usage frame follows.
      const cancelled = frame.error && frame.error.code === "cancelled";
      end(run, cancelled ? "cancelled" : "error", "", cancelled ? "" : describe(frame.error));
    } else if (frame.type === "usage") {
      const { column } = run;
      run.tokens = frame.usage.completion_tokens;
      run.requestId = frame.request_id;
      readout(run);
      column.el.dataset.requestId = frame.request_id;
      column.el.dataset.promptTokens = String(frame.usage.prompt_tokens);
      column.el.dataset.completionTokens = String(frame.usage.completion_tokens);
      const cached = frame.cache && frame.cache !== "miss" ? ` · answered from the cache (${frame.cache})` : "";
      field(column.el, "served").textContent =
        `Version ${frame.model_version} · ${frame.usage.prompt_tokens} prompt + ` +
        `${frame.usage.completion_tokens} completion tokens${cached} · request ${frame.request_id}`;
      relabel(run.assistant, `Assistant · ${run.model} · version ${frame.model_version}`);
      end(run, frame.status, frame.status_code, "");
      runs.delete(frame.id);
    }
  }

  function showFormError(text) {
    formError.textContent = text;
    formError.hidden = !text;
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
    const started = [];
    for (const column of active()) {
      counter += 1;
      const id = `${column.letter}-${counter}`;
      const frame = frameFor(column, chosen, id, chosen.message);
      const version = column.version.value;
      const run = {
        id, column, frame, model: column.model.value, startedAt: performance.now(), firstAt: null, tokens: 0,
        done: false, finishReason: null, error: "", requestId: "",
        user: addTurn(column, "user", chosen.message, "You"),
        assistant: addTurn(column, "assistant", "",
                           `Assistant · ${column.model.value} · ${version ? `version ${version}` : "routed"}`),
      };
      run.assistant.node.classList.add("pg-streaming");
      clearReadout(column);
      setStatus(column, "connecting", "");
      column.el.dataset.state = "running";
      column.el.dataset.runId = id;
      scrollDown(column);
      started.push(run);
    }
    form.elements.message.value = "";
    sendButton.disabled = true;
    newButton.disabled = true;
    let ws;
    try {
      ws = await openSocket();
    } catch (error) {
      for (const run of started) end(run, "error", "", error.message);
      showFormError(error.message);
      if (!form.elements.message.value) form.elements.message.value = chosen.message; // to send again
      updateButtons();
      return;
    }
    for (const run of started) {
      runs.set(run.id, run);
      run.column.lastSent = { frame: run.frame, at: new Date() };
      setStatus(run.column, "waiting for the first token", "");
      ws.send(JSON.stringify(run.frame));
    }
    updateButtons();
  }

  function stop() {
    if (!socket) return;
    for (const run of running()) {
      socket.send(JSON.stringify({ type: "cancel", id: run.id }));
      setStatus(run.column, "stopping", "");
    }
  }

  // --- "View code" --------------------------------------------------------------------

  const codeWhat = document.getElementById("pg-code-what");
  const codeColumns = document.getElementById("pg-code-columns");
  const codeStatus = document.getElementById("pg-code-status");
  const copied = document.getElementById("pg-copied");
  const tabs = Array.from(document.querySelectorAll(".pg-tabs [role=tab]"));

  // A JSON value written as a Python literal (JSON's strings are Python's).
  function python(value, indent = "") {
    if (value === null || value === undefined) return "None";
    if (value === true) return "True";
    if (value === false) return "False";
    if (typeof value === "number" || typeof value === "string") return JSON.stringify(value);
    const inner = `${indent}    `;
    if (Array.isArray(value)) {
      if (value.length === 0) return "[]";
      return `[\n${value.map((item) => `${inner}${python(item, inner)},\n`).join("")}${indent}]`;
    }
    const entries = Object.entries(value);
    if (entries.every(([, item]) => item === null || typeof item !== "object")) {
      return `{${entries.map(([key, item]) => `${JSON.stringify(key)}: ${python(item)}`).join(", ")}}`;
    }
    return `{\n${entries.map(([key, item]) => `${inner}${JSON.stringify(key)}: ${python(item, inner)},\n`).join("")}${indent}}`;
  }

  function shell(text) {
    return `'${text.replace(/'/g, "'\\''")}'`;
  }

  function snippets(frame) {
    // What the socket adds to every request (serving.consumers): a stream with its usage.
    const body = { ...frame.body, stream: true, stream_options: { include_usage: true } };
    const curl = [`curl -N ${config.apiBase}/chat/completions \\`,
                  '  -H "Authorization: Bearer $API_KEY" \\',
                  '  -H "Content-Type: application/json" \\'];
    if (frame.model_version) curl.push(`  -H ${shell(`X-Model-Version: ${frame.model_version}`)} \\`);
    curl.push(`  -d ${shell(JSON.stringify(body, null, 2))}`);

    const args = [];
    for (const [key, value] of Object.entries(body)) {
      if (key !== "cache") args.push(`    ${key}=${python(value, "    ")},`);
    }
    if (frame.model_version) args.push(`    extra_headers=${python({ "X-Model-Version": frame.model_version })},`);
    if ("cache" in body) args.push(`    extra_body=${python({ cache: body.cache })},  # the platform's own field`);
    const py = [
      "import os", "", "from openai import OpenAI", "",
      `client = OpenAI(base_url=${JSON.stringify(config.apiBase)}, api_key=os.environ["API_KEY"])`,
      "stream = client.chat.completions.create(", ...args, ")",
      "for chunk in stream:",
      "    if chunk.choices:",
      '        print(chunk.choices[0].delta.content or "", end="", flush=True)',
      "    if chunk.usage:",
      '        print("\\n", chunk.usage)',
    ];

    const ws = [
      "import json", "import os", "", "from websockets.sync.client import connect", "",
      "# The frame the playground sent (it signs in with your session; a program, with a key).",
      `frame = ${python(frame)}`,
      "headers = {\"Authorization\": f\"Bearer {os.environ['API_KEY']}\"}",
      `with connect(${JSON.stringify(config.socketUrl)}, additional_headers=headers) as ws:`,
      "    ws.send(json.dumps(frame))",
      "    while True:",
      "        message = json.loads(ws.recv())",
      '        if message["type"] == "chunk":',
      '            for choice in message["data"]["choices"]:',
      '                print(choice["delta"].get("content") or "", end="", flush=True)',
      "        # A request ends with its usage frame, or with an error frame when it was refused",
      "        # (one that fails once admitted sends an error frame, then its usage).",
      '        elif message["type"] in ("usage", "error"):',
      "            print()",
      "            print(message)",
      "            break",
    ];
    return { curl: curl.join("\n"), python: py.join("\n"), websocket: ws.join("\n") };
  }

  function codeColumn() {
    const shown = active();
    const picked = codeColumns.querySelector("input:checked");
    return shown.find((column) => picked && column.letter === picked.value) || shown[0];
  }

  function renderCode() {
    const shown = active();
    codeColumns.hidden = shown.length < 2;
    for (const column of columns) {
      const label = codeColumns.querySelector(`[data-code-column="${column.letter}"]`);
      label.textContent = `${column.letter.toUpperCase()}: ${column.model.value}`;
    }
    const column = codeColumn();
    const typed = form.elements.message.value.trim();
    let frame;
    if (!typed && column.lastSent) {
      ({ frame } = column.lastSent);
      codeWhat.textContent = `Exactly what was last sent, at ${column.lastSent.at.toLocaleTimeString("en-GB", { timeZone: "UTC" })} UTC.`;
    } else {
      const chosen = settings({ forCode: true });
      if (chosen.error) {
        codeWhat.textContent = `What Send would send now, once the form is fixed: ${chosen.error}`;
        const fallback = { temperature: 0.7, maxTokens: 256, system: form.elements.system.value.trim() };
        frame = frameFor(column, fallback, `${column.letter}-${counter + 1}`, typed || "Your message");
      } else {
        codeWhat.textContent = typed
          ? "What Send would send now, with the conversation so far."
          : "What Send would send now (\"Your message\" stands in for the message you have not written yet).";
        frame = frameFor(column, chosen, `${column.letter}-${counter + 1}`, typed || "Your message");
      }
    }
    const code = snippets(frame);
    for (const [name, text] of Object.entries(code)) {
      document.querySelector(`[data-code="${name}"]`).textContent = text;
    }
    const { outcome } = column;
    codeStatus.textContent = [outcome.words, outcome.code && `HTTP ${outcome.code}`,
                              outcome.requestId && `request ${outcome.requestId}`].filter(Boolean).join(" · ");
    copied.textContent = "";
  }

  function selectTab(tab, focus) {
    for (const other of tabs) {
      const selected = other === tab;
      other.setAttribute("aria-selected", String(selected));
      other.tabIndex = selected ? 0 : -1;
      document.getElementById(other.getAttribute("aria-controls")).hidden = !selected;
    }
    if (focus) tab.focus();
    copied.textContent = "";
  }

  tabs.forEach((tab, i) => {
    tab.addEventListener("click", () => selectTab(tab, false));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (event.key === "Home") selectTab(tabs[0], true);
      else if (event.key === "End") selectTab(tabs[tabs.length - 1], true);
      else if (step) selectTab(tabs[(i + step + tabs.length) % tabs.length], true);
      else return;
      event.preventDefault();
    });
  });

  document.getElementById("pg-copy").addEventListener("click", async () => {
    const panel = document.querySelector(".pg-panel:not([hidden]) code");
    try {
      await navigator.clipboard.writeText(panel.textContent);
      copied.textContent = "Copied.";
    } catch {
      window.getSelection().selectAllChildren(panel);
      copied.textContent = "Selected: press Ctrl+C to copy.";
    }
  });

  codeColumns.addEventListener("change", renderCode);
  // Runs before drawer.js (on the document) opens the dialog.
  codeButton.addEventListener("click", renderCode);

  // --- wiring -------------------------------------------------------------------------

  form.addEventListener("submit", send);
  stopButton.addEventListener("click", stop);
  newButton.addEventListener("click", newConversation);
  form.elements.message.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
  });
  showCompare();
})();
