// Submit: a form for the built-in workload, or the raw JSON spec; the API's 422 errors
// are shown next to the fields they name.
import { api, ApiError } from "../api.js";
import { el } from "../format.js";
import { flash } from "../notice.js";

// [API field, label, input attributes, hint]
const FIELDS = [
  ["name", "Name", { type: "text", value: "my-job", autocomplete: "off" },
    "Letters, digits, space, . _ -"],
  ["hyperparameters.model", "Model", { options: ["small_cnn", "resnet18", "resnet34",
    "resnet50", "mobilenet_v3_small", "efficientnet_b0"] }],
  ["hyperparameters.dataset", "Dataset", { options: ["synthetic", "imagefolder", "cifar10"] }],
  ["hyperparameters.data_path", "Data path", { type: "text" },
    "A directory every node can read (imagefolder: class folders; cifar10: its batches)"],
  ["hyperparameters.epochs", "Epochs", { type: "number", step: "1" },
    "Optional; the run stops at the first of epochs and max steps"],
  ["hyperparameters.max_steps", "Max steps", { type: "number", step: "1", value: "200" }],
  ["hyperparameters.global_batch_size", "Global batch", { type: "number", step: "1",
    value: "64" }, "Samples per optimizer step, across all workers"],
  ["hyperparameters.learning_rate", "Learning rate", { type: "number", step: "any",
    value: "0.05" }],
  ["scaling.min_workers", "Min workers", { type: "number", step: "1", value: "1" }],
  ["scaling.max_workers", "Max workers", { type: "number", step: "1", value: "2" }],
  ["scaling.cpus_per_worker", "CPUs per worker", { type: "number", step: "any", value: "1" }],
  ["scaling.gpus_per_worker", "GPUs per worker", { type: "number", step: "1", value: "0" },
    "Above 0: NCCL; else Gloo"],
  ["checkpoint.every_steps", "Checkpoint every (steps)", { type: "number", step: "1",
    value: "50" }],
  ["checkpoint.keep", "Checkpoints kept", { type: "number", step: "1", value: "3" }],
];
const GROUPS = [
  ["Job", ["name"]],
  ["Training", ["hyperparameters.model", "hyperparameters.dataset", "hyperparameters.data_path",
    "hyperparameters.epochs", "hyperparameters.max_steps", "hyperparameters.global_batch_size",
    "hyperparameters.learning_rate"]],
  ["Workers", ["scaling.min_workers", "scaling.max_workers", "scaling.cpus_per_worker",
    "scaling.gpus_per_worker"]],
  ["Checkpoints", ["checkpoint.every_steps", "checkpoint.keep"]],
];

const idOf = (field) => `f-${field.replaceAll(".", "-")}`;

export function submitPage(view, { signal }) {
  document.title = "Submit · elastic-train";
  const summary = el("div", { class: "error-summary", id: "submit-errors", role: "alert",
    tabindex: "-1" });
  summary.hidden = true;

  const fieldBox = (field) => {
    const [, label, attrs, hint] = FIELDS.find((f) => f[0] === field);
    const id = idOf(field);
    const described = [hint ? `${id}-hint` : null, `${id}-error`].filter(Boolean).join(" ");
    const input = attrs.options
      ? el("select", { id, name: field, "aria-describedby": described },
        attrs.options.map((o) => el("option", { value: o }, o)))
      : el("input", { id, name: field, "aria-describedby": described, ...attrs });
    const error = el("p", { class: "field-error", id: `${id}-error`, dataset: { field } });
    error.hidden = true;
    return el("div", { class: "field", dataset: { field } },
      el("label", { for: id }, label), input,
      hint ? el("p", { class: "hint", id: `${id}-hint` }, hint) : null, error);
  };

  const form = el("form", { id: "submit-form", novalidate: true, "aria-label": "Job spec" },
    el("p", { class: "hint" }, "Workload: ", el("code", {}, "image-classification"),
      " (built in)."),
    GROUPS.map(([title, fields]) => el("fieldset", {}, el("legend", {}, title),
      el("div", { class: "fields" }, fields.map(fieldBox)))),
    el("div", { class: "form-actions" },
      el("button", { type: "submit", class: "primary" }, "Submit job")));

  const json = el("textarea", { id: "spec-json", name: "spec", rows: "18", spellcheck: "false",
    "aria-describedby": "spec-json-hint" });
  const jsonForm = el("form", { id: "json-form", novalidate: true, "aria-label": "Raw JSON spec" },
    el("div", { class: "field" },
      el("label", { for: "spec-json" }, "Job spec (JSON)"), json,
      el("p", { class: "hint", id: "spec-json-hint" }, "Any spec the API accepts, e.g. a "
        + "custom workload or the failure settings (see README, The job spec).")),
    el("div", { class: "form-actions" },
      el("button", { type: "submit", class: "primary" }, "Submit JSON")));
  jsonForm.hidden = true;

  const tab = (id, label, panel, selected) => el("button", { type: "button", role: "tab",
    id, "aria-selected": String(selected), "aria-controls": panel, tabindex: selected ? "0" : "-1" },
  label);
  const tabs = el("div", { role: "tablist", class: "tabs", "aria-label": "How to give the spec" },
    tab("tab-form", "Form", "submit-form", true), tab("tab-json", "Raw JSON", "json-form", false));
  form.setAttribute("role", "tabpanel");
  form.setAttribute("aria-labelledby", "tab-form");
  jsonForm.setAttribute("role", "tabpanel");
  jsonForm.setAttribute("aria-labelledby", "tab-json");

  function select(which) {
    const toJson = which === "json";
    if (toJson) json.value = JSON.stringify(specFromForm(), null, 2);
    form.hidden = toJson;
    jsonForm.hidden = !toJson;
    for (const b of tabs.querySelectorAll("[role=tab]")) {
      const on = (b.id === "tab-json") === toJson;
      b.setAttribute("aria-selected", String(on));
      b.tabIndex = on ? 0 : -1;
    }
    clearErrors();
  }
  tabs.addEventListener("click", (e) => {
    if (e.target.id === "tab-form") select("form");
    if (e.target.id === "tab-json") select("json");
  });
  tabs.addEventListener("keydown", (e) => {
    if (e.key !== "ArrowLeft" && e.key !== "ArrowRight") return;
    const next = jsonForm.hidden ? "json" : "form";
    select(next);
    tabs.querySelector(`#tab-${next}`).focus();
  });

  const dataset = form.querySelector(`[name="hyperparameters.dataset"]`);
  const dataPath = form.querySelector(`[data-field="hyperparameters.data_path"]`);
  const showDataPath = () => { dataPath.hidden = dataset.value === "synthetic"; };
  dataset.addEventListener("change", showDataPath);
  showDataPath();

  view.append(el("h1", {}, "Submit a job"), summary, tabs, form, jsonForm);

  function specFromForm() {
    const spec = { workload: "image-classification" };
    for (const [field, , attrs] of FIELDS) {
      const input = form.querySelector(`[name="${field}"]`);
      if (input.closest("[hidden]")) continue;
      const raw = input.value.trim();
      if (raw === "") continue;
      const value = attrs.type === "number" && Number.isFinite(Number(raw)) ? Number(raw) : raw;
      const path = field.split(".");
      let node = spec;
      for (const key of path.slice(0, -1)) node = node[key] ??= {};
      node[path.at(-1)] = value;
    }
    return spec;
  }

  function clearErrors() {
    summary.hidden = true;
    summary.replaceChildren();
    for (const e of view.querySelectorAll(".field-error")) {
      e.hidden = true;
      e.textContent = "";
    }
    for (const i of view.querySelectorAll("[aria-invalid]")) i.removeAttribute("aria-invalid");
  }

  function showErrors(err, onForm) {
    const items = err.errors.length ? err.errors : [{ field: null, message: err.message }];
    const list = el("ul");
    let first = null;
    for (const { field, message } of items) {
      const input = onForm && field ? form.querySelector(`[name="${CSS.escape(field)}"]`) : null;
      if (input && !input.closest("[hidden]")) {
        const box = form.querySelector(`#${idOf(field)}-error`);
        box.textContent = message;
        box.hidden = false;
        input.setAttribute("aria-invalid", "true");
        first ??= input;
        list.append(el("li", {}, el("a", { href: `#${input.id}`, onclick: (e) => {
          e.preventDefault();
          input.focus();
        } }, field), `: ${message}`));
      } else {
        list.append(el("li", {}, field ? `${field}: ${message}` : message));
      }
    }
    summary.replaceChildren(el("p", {}, el("strong", {}, err.problem.title || "Not submitted"),
      " — nothing was created."), list);
    summary.hidden = false;
    (first || summary).focus();
  }

  async function submit(spec, onForm, button) {
    clearErrors();
    button.disabled = true;
    try {
      const job = await api("v1/jobs", { method: "POST", body: spec, signal });
      flash(`Submitted “${job.name}” (${job.id}).`);
      location.hash = "#/jobs";
    } catch (err) {
      if (signal.aborted) return;
      showErrors(err instanceof ApiError ? err : new ApiError(0, { detail: err.message }),
        onForm);
    } finally {
      button.disabled = false;
    }
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    submit(specFromForm(), true, e.submitter || form.querySelector("button[type=submit]"));
  });
  jsonForm.addEventListener("submit", (e) => {
    e.preventDefault();
    let spec;
    try {
      spec = JSON.parse(json.value);
    } catch (err) {
      clearErrors();
      showErrors(new ApiError(0, { title: "Not valid JSON", detail: err.message }), false);
      return;
    }
    submit(spec, false, e.submitter || jsonForm.querySelector("button[type=submit]"));
  });
}
