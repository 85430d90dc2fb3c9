// Registering a version: the artifact is read and hashed on submit, which can take a while,
// so say so and keep the button from sending the form twice.
"use strict";

(function () {
  const form = document.querySelector(".register-form");
  if (!form) return;
  const button = document.getElementById("register-submit");
  const progress = document.getElementById("register-progress");
  form.addEventListener("submit", function () {
    button.disabled = true;
    progress.hidden = false;
  });
})();
