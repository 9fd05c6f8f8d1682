// Jobs: a live table, newest first, filtered by state; rows follow GET /v1/events.
import { api, follow } from "../api.js";
import {
  clock, duration, el, jobDuration, number, priorityText, progress, rate, stateBadge, STATES,
  TERMINAL, worldText,
} from "../format.js";

const COLUMNS = ["Name", "Owner", "State", "Priority", "Workers now / min..max", "Step",
  "Last loss", "Samples/s", "Started", "Duration"];
// /v1/events announces state changes and resizes; steps and losses of running jobs are
// re-read this often while any are shown.
const ACTIVE_REFRESH_MS = 2000;

export function jobsPage(view, { signal }) {
  document.title = "Jobs · elastic-train";
  const jobs = new Map();
  const filter = el("select", { id: "state-filter", name: "state" },
    el("option", { value: "" }, "All states"),
    STATES.map((s) => el("option", { value: s }, s)));
  const live = el("span", { class: "live", role: "status" }, "Connecting…");
  const body = el("tbody");
  const empty = el("p", { class: "empty" }, "No jobs yet. ",
    el("a", { href: "#/submit" }, "Submit one"), ".");
  const table = el("table", { class: "jobs cards", id: "jobs-table" },
    el("caption", { class: "visually-hidden" }, "Jobs, newest first"),
    el("thead", {}, el("tr", {}, COLUMNS.map((c) => el("th", { scope: "col" }, c)))),
    body);
  view.append(
    el("div", { class: "page-head" },
      el("h1", {}, "Jobs"),
      el("div", { class: "toolbar" },
        el("label", { for: "state-filter" }, "State"), filter, live,
        el("a", { class: "button primary", href: "#/submit" }, "Submit a job"))),
    el("div", { class: "table-wrap" }, table),
    empty);

  const visible = (job) => !filter.value || job.state === filter.value;

  function row(job) {
    const cells = [
      el("a", { href: `#/jobs/${job.id}` }, job.name),
      job.owner,
      stateBadge(job.state),
      priorityText(job.priority),
      worldText(job),
      progress(job),
      number(job.last_loss),
      rate(job.samples_per_s),
      clock(job.started_at),
      el("span", { class: "duration" }, duration(jobDuration(job))),
    ];
    return el("tr", { dataset: { jobId: job.id, state: job.state } },
      cells.map((c, i) => el(i ? "td" : "th", { scope: i ? null : "row",
        dataset: { label: COLUMNS[i] } }, c)));
  }

  function render() {
    const shown = [...jobs.values()].filter(visible)
      .sort((a, b) => (a.created_at < b.created_at ? 1 : a.created_at > b.created_at ? -1
        : a.id < b.id ? 1 : -1));
    body.replaceChildren(...shown.map(row));
    table.hidden = shown.length === 0;
    empty.hidden = shown.length > 0;
    if (filter.value && !shown.length) empty.replaceChildren(`No ${filter.value} jobs.`);
  }

  async function load() {
    const query = filter.value ? `&state=${filter.value}` : "";
    const page = await api(`v1/jobs?limit=200${query}`, { signal });
    jobs.clear();
    for (const job of page.items) jobs.set(job.id, job);
    render();
  }

  filter.addEventListener("change", () => load().catch(() => {}));
  load().catch(() => {});

  follow("v1/events", {
    signal,
    endless: true,
    onStatus: (s) => {
      live.textContent = s === "live" ? "Live" : "Reconnecting…";
      live.dataset.status = s;
    },
    onReconnect: () => load().catch(() => {}),
    onMessage: ({ event, data }) => {
      if (event !== "job") return;
      const job = data.job;
      if (visible(job)) jobs.set(job.id, job);
      else jobs.delete(job.id);
      render();
    },
  }).catch(() => {});

  const timer = setInterval(() => {
    if ([...jobs.values()].some((j) => !TERMINAL.has(j.state))) load().catch(() => {});
  }, ACTIVE_REFRESH_MS);
  return () => clearInterval(timer);
}
