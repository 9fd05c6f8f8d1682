// How numbers, times and states are written on every page.

// The service generates states.js from its state machine.
export { STATES, TERMINAL } from "./states.js";

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value == null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "dataset") Object.assign(node.dataset, value);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child == null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function stateBadge(state) {
  return el("span", { class: `state state-${state}` }, state);
}

export function number(value, digits = 4) {
  if (value == null || Number.isNaN(value)) return "–";
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString("en-US");
  return Number(value).toPrecision(digits).replace(/\.?0+$/, "") || "0";
}

export function rate(value) {
  return value == null ? "–" : Math.round(value).toLocaleString("en-US");
}

export function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) {
    n /= 1024;
    i += 1;
  }
  return `${i ? n.toFixed(1) : n} ${units[i]}`;
}

export function toDate(value) {
  if (value == null) return null;
  return typeof value === "number" ? new Date(value * 1000) : new Date(value);
}

// The API writes every time in ISO 8601; charts place points by Unix seconds.
export function unixSeconds(value) {
  return toDate(value).getTime() / 1000;
}

export function clock(value) {
  const d = toDate(value);
  if (!d) return "–";
  const sameDay = d.toDateString() === new Date().toDateString();
  const time = d.toLocaleTimeString("en-GB", { hour12: false });
  return sameDay ? time : `${d.toLocaleDateString("en-CA")} ${time}`;
}

export function duration(seconds) {
  if (seconds == null || seconds < 0) return "–";
  const s = Math.floor(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  if (m) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  return `${s}s`;
}

export function jobDuration(job) {
  const start = toDate(job.started_at);
  if (!start) return null;
  const end = toDate(job.finished_at) || new Date();
  return (end - start) / 1000;
}

// The spec's named priority classes (jobs/spec.py): a number that is one shows its name.
const PRIORITY_NAMES = new Map([[0, "low"], [50, "normal"], [100, "high"]]);

export function priorityText(priority) {
  if (priority == null) return "–";
  const name = PRIORITY_NAMES.get(priority);
  return name ? `${name} (${priority})` : String(priority);
}

export function worldText(job) {
  return `${job.world_size} / ${job.min_workers ?? "?"}..${job.max_workers ?? "?"}`;
}

export function progress(job) {
  const total = job.total_steps;
  const text = total ? `${job.step} / ${total}` : String(job.step);
  const wrap = el("span", { class: "progress" }, el("span", { class: "num" }, text));
  if (total) {
    wrap.append(el("progress", { max: total, value: Math.min(job.step, total),
      "aria-label": `step ${job.step} of ${total}` }));
  }
  return wrap;
}

// One line that says what an event means, for the timeline and the chart markers.
export function describeEvent(event) {
  const d = event.data || {};
  switch (event.kind) {
    case "state":
      if (!d.previous) return `${d.state} (submitted)`;
      return `${d.previous} → ${d.state}${d.world_size ? ` at ${plural(d.world_size, "worker")}` : ""}`
        + (d.reason ? `: ${d.reason}` : "");
    case "attempt_started":
      return `attempt ${d.attempt} started with ${plural(d.world_size, "worker")}`
        + (d.checkpoint_step != null ? ` from the checkpoint of step ${d.checkpoint_step}` : "");
    case "worker_lost": {
      // Restart mode names the ranks and nodes; in place, the replicas gone (a lost one
      // replaced in the same quorum change leaves the size as it was) or the sizes.
      const ranks = d.ranks || [];
      const lost = ranks.length || (d.nodes || []).length || (d.replicas || []).length
        || (d.to_world != null ? d.from_world - d.to_world : 0);
      return `lost ${plural(lost, "worker")}`
        + (ranks.length ? ` (rank ${ranks.join(", ")})` : "")
        + ` at ${plural(d.from_world, "worker")}`
        + (d.pause_seconds != null ? `, training paused ${d.pause_seconds.toFixed(2)} s` : "");
    }
    case "resized":
      return `resized ${d.from_world} → ${d.to_world} workers`
        + (d.reason === "drain" ? " off a draining node" : d.reason ? ` (${d.reason})` : "")
        + (d.checkpoint_step != null ? ` from step ${d.checkpoint_step}` : "")
        + (d.steps_redone != null ? `, ${plural(d.steps_redone, "step")} redone` : "")
        + (d.recovery_seconds != null ? `, ${d.recovery_seconds.toFixed(1)} s to recover` : "");
    case "restored":
      return `restored the checkpoint of step ${d.checkpoint_step}`
        + (d.recovery_seconds != null ? ` (${d.recovery_seconds.toFixed(1)} s)` : "");
    case "scheduled":
      // The cluster's scheduler resized the job (or sent it back to the queue), and why.
      return `scheduler: ${d.from_world} → ${plural(d.to_world, "worker")}, ${d.reason}`;
    case "checkpoint_saved":
      return `checkpoint saved at step ${d.step}`;
    case "checkpoint_corrupt":
      return `checkpoint of step ${d.step} skipped: ${d.reason}`;
    default:
      return JSON.stringify(d).slice(0, 200);
  }
}

export function plural(n, word) {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}
