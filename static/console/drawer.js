// Drawers: a button with data-drawer="<dialog id>" opens that <dialog class="drawer"> (modal:
// focus moves into it, Escape or its Close button shuts it and focus returns to the button).
// A drawer marked data-open-on-load (its form was refused) opens with the page.
"use strict";

document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-drawer]");
  if (!button) {
    return;
  }
  const drawer = document.getElementById(button.dataset.drawer);
  if (drawer && !drawer.open) {
    drawer.showModal();
  }
});

document.addEventListener("click", (event) => {
  // A click on the backdrop (the dialog element itself, outside its content) closes it.
  if (event.target instanceof HTMLDialogElement && event.target.classList.contains("drawer")) {
    const box = event.target.getBoundingClientRect();
    const inside = event.clientX >= box.left && event.clientX <= box.right
      && event.clientY >= box.top && event.clientY <= box.bottom;
    if (!inside) {
      event.target.close();
    }
  }
});

document.querySelectorAll("dialog.drawer[data-open-on-load]").forEach((drawer) => drawer.showModal());
