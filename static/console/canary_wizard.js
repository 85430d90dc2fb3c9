// The canary wizard, one step at a time: Next checks the step's fields before moving on, the
// schedule follows the steps and interval as they are typed, and the last step reviews every
// choice before "Start canary". Refused by the server, it opens on the first step with an error.
"use strict";

(function () {
  const root = document.querySelector("[data-wizard]");
  if (!root) {
    return;
  }
  const form = root.querySelector("form");
  const steps = [...root.querySelectorAll("fieldset[data-step]")];
  const marks = [...root.querySelectorAll(".wizard-steps li")];
  const back = root.querySelector("[data-wizard-back]");
  const next = root.querySelector("[data-wizard-next]");
  const submit = root.querySelector("[data-wizard-submit]");
  const review = root.querySelector("[data-review]");
  let at = 0;

  function show(index) {
    at = index;
    steps.forEach((step, i) => { step.hidden = i !== index; });
    marks.forEach((mark, i) => {
      mark.classList.toggle("done", i < index);
      mark.classList.toggle("current", i === index);
      if (i === index) {
        mark.setAttribute("aria-current", "step");
      } else {
        mark.removeAttribute("aria-current");
      }
    });
    back.hidden = index === 0;
    next.hidden = index === steps.length - 1;
    submit.hidden = index !== steps.length - 1;
    if (steps[index] === review) {
      fillReview();
    }
    const first = steps[index].querySelector("input, select");
    if (first) {
      first.focus();
    }
  }

  function stepValid(index) {
    for (const input of steps[index].querySelectorAll("input, select")) {
      if (!input.checkValidity()) {
        input.reportValidity();
        return false;
      }
    }
    if (index === 1 && !schedule()) {
      const field = form.elements.steps;
      field.setCustomValidity("Give whole percentages separated by commas, increasing, e.g. 5,25,50,100.");
      field.reportValidity();
      field.setCustomValidity("");
      return false;
    }
    return true;
  }

  // (percent, from second, to second) per step at the fastest, as the server's schedule says.
  function schedule() {
    const parts = form.elements.steps.value.split(",").map((p) => p.trim().replace(/%$/, "")).filter(Boolean);
    const interval = Number(form.elements.interval_seconds.value);
    if (!parts.length || !parts.every((p) => /^\d+$/.test(p)) || !(interval >= 1)) {
      return null;
    }
    const percents = parts.map(Number);
    if (percents.some((p, i) => p < 1 || p > 100 || (i > 0 && p <= percents[i - 1]))) {
      return null;
    }
    return percents.map((percent, i) => [percent, i * interval, (i + 1) * interval]);
  }

  function showSchedule() {
    const list = document.getElementById("canary-schedule");
    const earliest = document.getElementById("canary-earliest");
    const rows = schedule();
    if (!rows) {
      list.replaceChildren();
      earliest.textContent = "The schedule shows once the steps and the interval are valid";
      return;
    }
    list.replaceChildren(...rows.map(([percent, begins, ends]) => {
      const item = document.createElement("li");
      item.textContent = `${percent} % of the requests to the candidate from ${begins} s to ${ends} s`;
      return item;
    }));
    earliest.textContent = `The earliest it can finish is ${rows[rows.length - 1][2]} s after it starts`;
  }

  function fillReview() {
    const box = document.getElementById("canary-review");
    const value = (name) => form.elements[name].value.trim();
    const rows = schedule() || [];
    const criteria = [];
    if (value("min_success_rate")) criteria.push(`success rate ≥ ${value("min_success_rate")} %`);
    if (value("max_p99_latency_ms")) criteria.push(`p99 latency ≤ ${value("max_p99_latency_ms")} ms`);
    if (value("max_ttft_p99_ms")) criteria.push(`p99 TTFT ≤ ${value("max_ttft_p99_ms")} ms`);
    const facts = [
      ["Versions", `${value("base_version")} → ${value("canary_version")}`],
      ["Steps", rows.map((r) => `${r[0]} %`).join(" → ")],
      ["Each window", `${value("interval_seconds")} s, at least ${value("min_samples")} request${value("min_samples") === "1" ? "" : "s"} per arm`],
      ["Earliest finish", rows.length ? `${rows[rows.length - 1][2]} s after it starts` : "–"],
      ["Criteria", criteria.length ? criteria.join(", ") : "the statistical tests only"],
      ["At the end", form.elements.auto_promote.checked ? "promoted without a person" : "waits for a person to promote"],
    ];
    box.replaceChildren(...facts.map(([term, text]) => {
      const div = document.createElement("div");
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = term;
      dd.textContent = text;
      dd.dataset.review = term;
      div.append(dt, dd);
      return div;
    }));
  }

  root.querySelector(".wizard-steps").hidden = false;
  next.addEventListener("click", () => {
    if (stepValid(at)) {
      show(at + 1);
    }
  });
  back.addEventListener("click", () => show(at - 1));
  form.elements.steps.addEventListener("input", showSchedule);
  form.elements.interval_seconds.addEventListener("input", showSchedule);
  form.addEventListener("keydown", (event) => {
    // Enter moves on a step rather than starting the canary from the middle of the wizard.
    if (event.key === "Enter" && event.target.tagName === "INPUT" && at < steps.length - 1) {
      event.preventDefault();
      next.click();
    }
  });
  showSchedule();
  const refused = steps.findIndex((step) => step.querySelector(".field-invalid"));
  show(refused >= 0 ? refused : 0);
})();
