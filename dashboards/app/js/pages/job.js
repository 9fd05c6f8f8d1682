// One job: header and cancel, live charts (loss/accuracy, samples/s, world size with
// markers), the events timeline, a following log tail and the checkpoints.
import { api, ApiError, follow, sleep } from "../api.js";
import { lineChart } from "../charts.js";
import {
  bytes, clock, describeEvent, duration, el, jobDuration, number, progress, rate, stateBadge,
  TERMINAL, toDate, unixSeconds, worldText,
} from "../format.js";

const TIMELINE_KINDS = ["state", "attempt_started", "worker_lost", "resized", "restored",
  "scheduled", "checkpoint_saved", "checkpoint_corrupt"];
const MARKER_KINDS = new Set(["worker_lost", "resized", "restored"]);
const TIMELINE_SHOWN = 300;
const LOG_LINES_SHOWN = 1000;
// The server downsamples: a chart never holds more than this many points, however long
// the run (100 000 steps draw as fast as 100).
const CHART_POINTS = 1500;
const METRICS_REFRESH_MS = 1500;

export function jobPage(view, { params: [jobId], signal }) {
  document.title = "Job · elastic-train";
  let job = null;
  const events = [];
  const head = el("section", { class: "job-head" });
  const subtitle = el("p", { class: "subtitle hint" });
  const actions = el("div", { class: "actions" });
  const charts = {};
  const timeline = el("ol", { class: "timeline", id: "timeline" });
  const timelineNote = el("p", { class: "hint" }, "No events yet.");
  const logs = el("pre", { class: "logs", id: "logs", tabindex: "0",
    "aria-label": "Worker log tail" });
  const followLogs = el("input", { type: "checkbox", id: "follow-logs", checked: true });
  const checkpoints = el("tbody");
  const checkpointsEmpty = el("p", { class: "empty" }, "No checkpoints yet.");

  const figure = (id, title) => el("figure", { class: "chart-card" },
    el("figcaption", {}, title), el("div", { class: "chart", id }));
  const chartGrid = el("div", { class: "charts" },
    figure("chart-loss", "Loss and accuracy vs step"),
    figure("chart-rate", "Throughput (samples/s) vs time"),
    figure("chart-world", "World size vs time"));

  view.append(
    el("p", { class: "crumbs" }, el("a", { href: "#/jobs" }, "← Jobs")),
    el("div", { class: "page-head" }, el("h1", { id: "job-title" }, "Job"), actions),
    subtitle,
    head,
    chartGrid,
    el("p", { class: "legend-markers hint" }, "Markers on the world-size chart: ",
      el("span", { class: "key key-worker_lost" }, "worker lost"), " ",
      el("span", { class: "key key-resized" }, "resized"), " ",
      el("span", { class: "key key-restored" }, "checkpoint restored"),
      " (hover or focus one for the event)."),
    el("div", { class: "two-col" },
      el("section", { "aria-labelledby": "events-title" },
        el("h2", { id: "events-title" }, "Events"), timelineNote, timeline),
      el("section", { "aria-labelledby": "logs-title" },
        el("div", { class: "section-head" }, el("h2", { id: "logs-title" }, "Log"),
          el("label", { class: "inline" }, followLogs, " Follow")),
        logs)),
    el("section", { "aria-labelledby": "ckpt-title" },
      el("h2", { id: "ckpt-title" }, "Checkpoints"),
      el("div", { class: "table-wrap" }, el("table", { class: "checkpoints cards" },
        el("thead", {}, el("tr", {}, ["Step", "Saved", "Size", "Path"].map(
          (c) => el("th", { scope: "col" }, c)))),
        checkpoints)),
      checkpointsEmpty));

  // -- header and cancel ----------------------------------------------------------------

  function renderHead() {
    document.title = `${job.name} · elastic-train`;
    view.querySelector("#job-title").replaceChildren(job.name, " ", stateBadge(job.state));
    const stat = (label, value) => el("div", { class: "stat" },
      el("dt", {}, label), el("dd", {}, value));
    head.replaceChildren(
      job.message ? el("p", { class: `message ${job.state === "failed" ? "error" : ""}` },
        job.message) : "",
      el("dl", { class: "stats" },
        stat("State", stateBadge(job.state)),
        stat("Workers now / min..max", worldText(job)),
        stat("Step", progress(job)),
        stat("Last loss", number(job.last_loss)),
        stat("Samples/s", rate(job.samples_per_s)),
        stat("Restarts", String(job.restarts)),
        stat("Started", clock(job.started_at)),
        stat("Duration", duration(jobDuration(job)))));
    subtitle.replaceChildren(el("code", {}, job.id), ` · ${job.workload} · submitted by `
      + `${job.owner} at ${clock(job.created_at)}`);
    const ended = TERMINAL.has(job.state);
    if (ended !== actionsEnded) renderActions(); // not on every refresh: it would take focus
  }

  let confirming = false;
  let actionsEnded = null;
  function renderActions() {
    const ended = TERMINAL.has(job.state);
    actionsEnded = ended;
    if (ended) confirming = false;
    if (!confirming) {
      actions.replaceChildren(el("button", { type: "button", class: "danger", id: "cancel-job",
        disabled: ended, onclick: () => { confirming = true; renderActions();
          actions.querySelector("#confirm-cancel").focus(); } }, "Cancel job"));
      return;
    }
    const status = el("span", { class: "error", role: "alert" });
    actions.replaceChildren(
      el("span", {}, "Cancel this job?"),
      el("button", { type: "button", class: "danger", id: "confirm-cancel", onclick: async (e) => {
        e.target.disabled = true;
        try {
          job = await api(`v1/jobs/${jobId}/cancel`, { method: "POST", signal });
          confirming = false;
          renderHead();
        } catch (err) {
          status.textContent = err.message;
          e.target.disabled = false;
        }
      } }, "Yes, cancel it"),
      el("button", { type: "button", onclick: () => { confirming = false; renderActions(); } },
        "Keep it running"),
      status);
  }

  async function loadJob() {
    job = await api(`v1/jobs/${jobId}`, { signal });
    renderHead();
  }

  // -- charts -------------------------------------------------------------------------

  const markers = () => events.filter((e) => MARKER_KINDS.has(e.kind))
    .map((e) => ({ x: unixSeconds(e.time), kind: e.kind, label: describeEvent(e) }));
  charts.loss = lineChart(view.querySelector("#chart-loss"), {
    xTime: false,
    series: [
      { label: "loss", color: "loss", scale: "loss" },
      { label: "accuracy", color: "accuracy", scale: "acc" },
    ],
    axes: [{ label: "step" }, { scale: "loss", label: "loss" },
      { scale: "acc", side: 1, label: "accuracy", grid: { show: false } }],
  });
  charts.rate = lineChart(view.querySelector("#chart-rate"), {
    xTime: true,
    series: [{ label: "samples/s", color: "rate", spanGaps: false }],
    axes: [{}, { size: 64 }], // room for "10,000"
  });
  charts.world = lineChart(view.querySelector("#chart-world"), {
    xTime: true,
    stepped: true,
    series: [{ label: "workers", color: "world" }],
    axes: [{}, { label: "workers", incrs: [1, 2, 5, 10, 20, 50, 100] }],
    markers,
  });

  function renderCharts(m) {
    const c = m.columns;
    // Steps redone after a restore replace the lost attempt's: keep the last of each step.
    const byStep = new Map();
    c.step.forEach((s, i) => byStep.set(s, i));
    const steps = [...byStep.keys()].sort((a, b) => a - b);
    const at = steps.map((s) => byStep.get(s));
    charts.loss.update([steps, at.map((i) => c.loss[i]), at.map((i) => c.accuracy[i])]);
    // A gap while the job restarted is a gap, not a line: a null at each later attempt.
    const rate = c.time.map((t, i) => [unixSeconds(t), c.samples_per_s[i]]);
    events.filter((e) => e.kind === "attempt_started" && e.data.attempt > 1)
      .forEach((e) => rate.push([unixSeconds(e.time), null]));
    rate.sort((a, b) => a[0] - b[0]);
    charts.rate.update([rate.map((p) => p[0]), rate.map((p) => p[1])]);
    // World size: what the metrics saw, plus each attempt's start and the job's end.
    const points = c.time.map((t, i) => [unixSeconds(t), c.world_size[i]]);
    for (const e of events) {
      if (e.kind === "attempt_started") points.push([unixSeconds(e.time), e.data.world_size]);
      if (e.kind === "worker_lost") points.push([unixSeconds(e.time), e.data.from_world]);
      if (e.kind === "state" && TERMINAL.has(e.data.state)) points.push([unixSeconds(e.time), 0]);
    }
    points.sort((a, b) => a[0] - b[0]);
    charts.world.update([points.map((p) => p[0]), points.map((p) => p[1])]);
  }

  let metricsDue = true;
  async function pollMetrics() {
    while (!signal.aborted) {
      const active = job && !TERMINAL.has(job.state);
      if (metricsDue || active) {
        metricsDue = false;
        if (active) loadJob().catch(() => {});
        try {
          renderCharts(await api(`v1/jobs/${jobId}/metrics?points=${CHART_POINTS}`, { signal }));
        } catch (err) {
          if (signal.aborted || (err instanceof ApiError && err.status === 404)) return;
        }
      }
      await sleep(METRICS_REFRESH_MS, signal);
    }
  }

  // -- events, checkpoints, logs ---------------------------------------------------------

  function renderTimeline() {
    const shown = events.slice(-TIMELINE_SHOWN).reverse();
    timelineNote.textContent = events.length > TIMELINE_SHOWN
      ? `Newest ${TIMELINE_SHOWN} of ${events.length} events.` : "Newest first.";
    timeline.replaceChildren(...shown.map((e) => el("li", { class: `ev ev-${e.kind}`,
      dataset: { kind: e.kind, seq: e.seq } },
      el("time", { datetime: toDate(e.time).toISOString() }, clock(e.time)),
      el("span", { class: "kind" }, e.kind.replace("_", " ")),
      el("span", { class: "what" }, describeEvent(e)))));
  }

  async function loadCheckpoints() {
    const list = await api(`v1/jobs/${jobId}/checkpoints`, { signal });
    checkpoints.replaceChildren(...list.items.slice().reverse().map((c) => el("tr", {},
      el("td", { dataset: { label: "Step" } }, String(c.step)),
      el("td", { dataset: { label: "Saved" } }, clock(c.created_at)),
      el("td", { dataset: { label: "Size" } }, bytes(c.size_bytes)),
      el("td", { dataset: { label: "Path" } }, el("code", {}, c.path)))));
    checkpointsEmpty.hidden = list.items.length > 0;
    checkpoints.closest(".table-wrap").hidden = list.items.length === 0;
  }

  let checkpointTimer = null;
  function checkpointsChanged() {
    if (checkpointTimer) return;
    checkpointTimer = setTimeout(() => {
      checkpointTimer = null;
      loadCheckpoints().catch(() => {});
    }, 1000);
  }

  let redrawQueued = false;
  function onEvent({ data: event }) {
    events.push(event);
    if (event.kind === "state" || event.kind === "resized") {
      loadJob().catch(() => {});
      metricsDue = true;
    }
    if (event.kind.startsWith("checkpoint")) checkpointsChanged();
    if (!redrawQueued) {
      redrawQueued = true;
      requestAnimationFrame(() => {
        redrawQueued = false;
        renderTimeline();
        charts.world.redraw();
      });
    }
  }

  const logLines = [];
  let logQueued = false;
  function onLog({ data: event }) {
    const d = event.data;
    for (const [t, stream, text] of d.lines) {
      logLines.push(`${clock(t)} [rank ${d.rank} a${d.attempt}${stream === "stderr" ? " err" : ""}] ${text}`);
    }
    if (logLines.length > LOG_LINES_SHOWN) logLines.splice(0, logLines.length - LOG_LINES_SHOWN);
    if (logQueued) return;
    logQueued = true;
    requestAnimationFrame(() => {
      logQueued = false;
      logs.textContent = logLines.join("\n");
      if (followLogs.checked) logs.scrollTop = logs.scrollHeight;
    });
  }

  loadJob().then(() => {
    const kinds = TIMELINE_KINDS.map((k) => `kind=${k}`).join("&");
    follow(`v1/jobs/${jobId}/events?${kinds}`, { signal, onMessage: onEvent }).catch(() => {});
    follow(`v1/jobs/${jobId}/logs?follow=true`, { signal, onMessage: onLog }).catch(() => {});
    pollMetrics();
    loadCheckpoints().catch(() => {});
  }).catch((err) => {
    if (signal.aborted) return;
    view.replaceChildren(el("h1", {}, "Job not found"),
      el("p", { class: "error" }, err.message), el("a", { href: "#/jobs" }, "← Jobs"));
  });

  const ticker = setInterval(() => {
    if (job && !TERMINAL.has(job.state)) {
      const d = head.querySelectorAll(".stat dd")[7];
      if (d) d.textContent = duration(jobDuration(job));
    }
  }, 1000);

  return () => {
    clearInterval(ticker);
    clearTimeout(checkpointTimer);
    Object.values(charts).forEach((c) => c.destroy());
  };
}
