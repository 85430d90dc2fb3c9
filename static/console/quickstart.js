// Copy buttons of the quickstart's snippets.
"use strict";

(() => {
  const status = document.getElementById("qs-copied");

  function copyBySelection(text) {
    // Without the clipboard API (plain http on another host): through a hidden selection.
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.opacity = "0";
    document.body.append(area);
    area.select();
    const copied = document.execCommand("copy");
    area.remove();
    if (!copied) throw new Error("copy refused");
  }

  async function copy(text) {
    if (navigator.clipboard && window.isSecureContext) {
      try {
        await navigator.clipboard.writeText(text);
        return;
      } catch (error) {
        // Refused (no permission): try the old way.
      }
    }
    copyBySelection(text);
  }

  for (const button of document.querySelectorAll("button[data-copy]")) {
    button.addEventListener("click", async () => {
      const code = document.getElementById(button.dataset.copy);
      try {
        await copy(code.textContent);
        button.textContent = "Copied";
        status.textContent = "Copied to the clipboard.";
      } catch (error) {
        button.textContent = "Copy failed";
        status.textContent = "Could not copy: select the text and copy it by hand.";
      }
      window.setTimeout(() => {
        button.textContent = "Copy";
      }, 2000);
    });
  }
})();
