// Uploading an artifact: the files go up in one XMLHttpRequest so its upload events can drive
// the progress bar; a folder's files carry their relative paths in a "paths" field beside them
// (the server's multipart parser keeps only base names). The server answers JSON: where to go
// next, with the SHA-256 and size it computed, or the form's errors.
"use strict";

(function () {
  const form = document.getElementById("upload-form");
  if (!form) return;
  const folder = document.getElementById("id_folder");
  const files = document.getElementById("id_artifact_files");
  const picked = document.getElementById("upload-picked");
  const errors = document.getElementById("upload-errors");
  const progress = document.getElementById("upload-progress");
  const bar = document.getElementById("upload-bar");
  const percent = document.getElementById("upload-percent");
  const label = document.getElementById("upload-label");
  const result = document.getElementById("upload-result");
  const button = document.getElementById("upload-submit");
  const limit = Number(form.dataset.limit);

  function chosen() {
    const list = [];
    for (const file of folder.files) list.push([file, file.webkitRelativePath || file.name]);
    for (const file of files.files) list.push([file, file.name]);
    return list;
  }

  function describe() {
    const list = chosen();
    const bytes = list.reduce((sum, [file]) => sum + file.size, 0);
    const files = list.length === 1 ? "1 file" : list.length + " files";
    picked.textContent = list.length ? files + ", " + bytes.toLocaleString() + (bytes === 1 ? " byte" : " bytes") : "";
  }

  function showErrors(messages) {
    errors.replaceChildren();
    for (const message of messages) {
      const p = document.createElement("p");
      p.textContent = message;
      errors.appendChild(p);
    }
    errors.hidden = messages.length === 0;
    if (messages.length) errors.scrollIntoView({ block: "nearest" });
  }

  function fieldLabel(name) {
    const element = form.querySelector('label[for="id_' + name + '"]');
    return element ? element.textContent.trim() + ": " : "";
  }

  function setProgress(value) {
    bar.value = value;
    percent.textContent = value + " %";
  }

  folder.addEventListener("change", describe);
  files.addEventListener("change", describe);

  form.addEventListener("submit", function (event) {
    event.preventDefault();
    const list = chosen();
    const bytes = list.reduce((sum, [file]) => sum + file.size, 0);
    if (!list.length) return showErrors(["Choose a folder, its files, or one .tar or .zip."]);
    if (bytes > limit) {
      return showErrors(["The files come to " + bytes.toLocaleString() + " bytes, over the limit of " + form.dataset.limitText + "."]);
    }
    showErrors([]);
    const data = new FormData();
    for (const element of form.elements) {
      if (!element.name || element.type === "file" || element.type === "submit") continue;
      if (element.type === "checkbox" && !element.checked) continue;
      data.append(element.name, element.value);
    }
    for (const [file, path] of list) {
      data.append("artifact_files", file, file.name);
      data.append("paths", path);
    }
    const request = new XMLHttpRequest();
    request.open("POST", form.action || window.location.href);
    request.setRequestHeader("X-Requested-With", "XMLHttpRequest");
    request.upload.addEventListener("progress", function (e) {
      if (e.lengthComputable) setProgress(Math.floor((e.loaded / e.total) * 100));
    });
    request.upload.addEventListener("load", function () {
      setProgress(100);
      label.textContent = "Uploaded; storing and hashing…";
    });
    request.addEventListener("load", function () {
      let body = {};
      try { body = JSON.parse(request.responseText); } catch (e) { body = {}; }
      if (request.status === 200 && body.redirect) {
        label.textContent = "Registered.";
        result.hidden = false;
        result.textContent = body.message;
        result.dataset.sha256 = body.sha256;
        window.setTimeout(function () { window.location.assign(body.redirect); }, 1500);
        return;
      }
      button.disabled = false;
      progress.hidden = true;
      const messages = [];
      for (const [name, items] of Object.entries(body.errors || {})) {
        for (const item of items) messages.push((name === "__all__" ? "" : fieldLabel(name)) + item.message);
      }
      if (!messages.length) messages.push("The upload failed (HTTP " + request.status + "). Try again.");
      showErrors(messages);
    });
    request.addEventListener("error", function () {
      button.disabled = false;
      progress.hidden = true;
      showErrors(["The upload was interrupted (the connection failed). Try again."]);
    });
    button.disabled = true;
    progress.hidden = false;
    label.textContent = "Uploading…";
    setProgress(0);
    request.send(data);
  });
})();
