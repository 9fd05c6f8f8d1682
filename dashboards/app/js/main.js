// The shell: sign-in, navigation between pages (hash routes, no reloads), sign-out.
import { api, ApiError, session, whenUnauthorized } from "./api.js";
import { el } from "./format.js";
import { takeNotice } from "./notice.js";
import { clusterPage } from "./pages/cluster.js";
import { jobPage } from "./pages/job.js";
import { jobsPage } from "./pages/jobs.js";
import { submitPage } from "./pages/submit.js";

const main = document.getElementById("main");
const nav = document.getElementById("nav");
const signOutButton = document.getElementById("sign-out");

const ROUTES = [
  [/^#\/jobs\/([A-Za-z0-9_-]+)$/, "jobs", jobPage],
  [/^#\/submit$/, "submit", submitPage],
  [/^#\/cluster$/, "cluster", clusterPage],
  [/^(#\/?(jobs)?)?$/, "jobs", jobsPage],
];

let current = null; // {controller, cleanup}
function leave() {
  if (!current) return;
  current.controller.abort();
  current.cleanup?.();
  current = null;
}

function signInPage(message) {
  leave();
  nav.hidden = true;
  signOutButton.hidden = true;
  document.title = "Sign in · elastic-train";
  const error = el("p", { class: "error", id: "token-error", role: "alert" }, message || "");
  error.hidden = !message;
  const input = el("input", { id: "token", name: "token", type: "password", required: true,
    autocomplete: "current-password", "aria-describedby": "token-hint token-error" });
  const form = el("form", { class: "card signin", "aria-labelledby": "signin-title" },
    el("h1", { id: "signin-title" }, "Sign in"),
    el("div", { class: "field" },
      el("label", { for: "token" }, "API token"),
      input,
      el("p", { class: "hint", id: "token-hint" },
        "The token that ", el("code", {}, "etrain serve"), " printed (or ",
        el("code", {}, "ETRAIN_API_TOKEN"), "). It is kept in this browser tab only, until "
        + "you sign out or close it."),
      error),
    el("button", { type: "submit", class: "primary" }, "Sign in"));
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const token = input.value.trim();
    error.hidden = true;
    if (!token) {
      error.textContent = "Enter the token.";
      error.hidden = false;
      return;
    }
    try {
      await api("v1/jobs?limit=1", { token });
    } catch (err) {
      error.textContent = err instanceof ApiError && err.status === 401
        ? "That token is not valid." : `The service did not answer: ${err.message}`;
      error.hidden = false;
      input.focus();
      return;
    }
    session.signIn(token);
    route();
  });
  main.replaceChildren(form);
  input.focus();
}

function route() {
  if (!session.token()) {
    signInPage();
    return;
  }
  leave();
  nav.hidden = false;
  signOutButton.hidden = false;
  const hash = location.hash;
  for (const [pattern, section, page] of ROUTES) {
    const match = hash.match(pattern);
    if (!match) continue;
    for (const link of nav.querySelectorAll("a")) {
      if (link.dataset.nav === section) link.setAttribute("aria-current", "page");
      else link.removeAttribute("aria-current");
    }
    const controller = new AbortController();
    const view = el("div", { class: "page" });
    const notice = takeNotice();
    if (notice) view.append(el("p", { class: "notice", role: "status" }, notice));
    main.replaceChildren(view);
    current = { controller };
    current.cleanup = page(view, { params: match.slice(1), signal: controller.signal });
    return;
  }
  main.replaceChildren(el("div", { class: "page" }, el("h1", {}, "Not found"),
    el("p", {}, el("a", { href: "#/jobs" }, "Back to the jobs"))));
}

whenUnauthorized(() => {
  session.signOut();
  signInPage("Your token was refused: sign in again.");
});

signOutButton.addEventListener("click", () => {
  session.signOut();
  signInPage();
});

window.addEventListener("hashchange", route);
route();
