// A batch's page: its Copy button puts the batch id on the clipboard and says so to screen readers.
"use strict";

document.addEventListener("DOMContentLoaded", () => {
  for (const button of document.querySelectorAll("button[data-copy-text]")) {
    button.addEventListener("click", async () => {
      const status = document.getElementById("copy-status");
      try {
        await navigator.clipboard.writeText(button.dataset.copyText);
        button.textContent = "Copied";
        if (status) status.textContent = "The batch id is copied to the clipboard.";
      } catch {
        // No clipboard (an insecure origin, a denied permission): select the id to copy by hand.
        const id = button.parentElement.querySelector(".batch-id");
        if (id) window.getSelection().selectAllChildren(id);
        if (status) status.textContent = "Select the id and copy it (Ctrl+C or ⌘C).";
      }
      setTimeout(() => { button.textContent = "Copy"; }, 2000);
    });
  }
});
