// Cluster: the Ray nodes with their CPUs/GPUs, which job holds which workers, and the
// scheduler's queue (GET /v1/queue): who waits, in which order and why, who holds what, and
// the quotas. Another user's entries show their place and sizes only: the API leaves out
// whose and which job they are.
import { api, sleep } from "../api.js";
import { el, number, plural, priorityText, stateBadge } from "../format.js";

const REFRESH_MS = 3000;
const QUEUE_COLUMNS = ["Position", "Job", "Owner", "Priority", "Reason"];
const HOLDER_COLUMNS = ["Job", "Owner", "Priority", "Workers / min..max", "Borrowed"];

// A job the caller may see links to its page; another user's is only "another user's job".
function jobCell(entry) {
  if (!entry.visible) return el("span", { class: "muted" }, "another user's job");
  return el("a", { href: `#/jobs/${entry.job_id}` }, entry.name || entry.job_id);
}

const limitText = (value, noun) => (value == null ? "no limit" : plural(value, noun));

function cells(columns, values) {
  return values.map((v, i) => el(i ? "td" : "th", { scope: i ? null : "row",
    dataset: { label: columns[i] } }, v));
}

function meter(label, free, total) {
  if (!total) return el("span", { class: "muted" }, "none");
  const used = total - free;
  return el("span", { class: "meter-cell" },
    el("span", { class: "num" }, `${number(used, 3)} / ${number(total, 3)} used`),
    el("meter", { min: 0, max: total, value: used, "aria-label": `${label} used` }));
}

export function clusterPage(view, { signal }) {
  document.title = "Cluster · elastic-train";
  const summary = el("p", { class: "summary", id: "cluster-summary" }, "Loading…");
  const nodes = el("tbody");
  const jobs = el("tbody");
  const jobsEmpty = el("p", { class: "empty" }, "No job holds workers now.");
  const dead = el("details", { class: "dead-nodes" });
  const waiting = el("tbody");
  const waitingEmpty = el("p", { class: "empty", id: "queue-empty" }, "No job waits.");
  // The API answers the first page of a long queue; the rest is counted, not listed.
  const waitingMore = el("p", { class: "empty", id: "queue-more" });
  const queueError = el("p", { class: "error", role: "alert" });
  queueError.hidden = true;
  const holders = el("tbody");
  const holdersEmpty = el("p", { class: "empty" }, "No job holds workers in the scheduler's view.");
  const quotas = el("tbody");
  const table = (id, columns, body) => el("div", { class: "table-wrap" },
    el("table", { class: "cards", id },
      el("thead", {}, el("tr", {}, columns.map((c) => el("th", { scope: "col" }, c)))), body));
  view.append(
    el("h1", {}, "Cluster"), summary,
    el("section", { "aria-labelledby": "nodes-title" },
      el("h2", { id: "nodes-title" }, "Nodes"),
      el("div", { class: "table-wrap" }, el("table", { class: "nodes cards", id: "nodes-table" },
        el("thead", {}, el("tr", {}, ["Node", "CPUs", "GPUs", "Workers"].map(
          (c) => el("th", { scope: "col" }, c)))), nodes)),
      dead),
    el("section", { "aria-labelledby": "placement-title" },
      el("h2", { id: "placement-title" }, "Workers by job"),
      el("div", { class: "table-wrap" }, el("table", { class: "placement cards", id: "placement-table" },
        el("thead", {}, el("tr", {}, ["Job", "State", "World size", "Workers (rank → node)"].map(
          (c) => el("th", { scope: "col" }, c)))), jobs)),
      jobsEmpty),
    el("section", { "aria-labelledby": "queue-title" },
      el("h2", { id: "queue-title" }, "Queue"),
      queueError,
      table("queue-table", QUEUE_COLUMNS, waiting),
      waitingEmpty,
      waitingMore,
      el("h3", { id: "holders-title" }, "Who holds what"),
      table("holders-table", HOLDER_COLUMNS, holders),
      holdersEmpty,
      el("h3", { id: "quotas-title" }, "Quotas"),
      table("quotas-table", ["Owner", "Workers", "GPUs"], quotas)));

  const nodeName = (n) => `${n.address || "?"} · ${n.node_id.slice(0, 8)}`;

  function render(c) {
    const alive = c.nodes.filter((n) => n.alive);
    const gone = c.nodes.filter((n) => !n.alive);
    const sum = (key, res) => alive.reduce((a, n) => a + (n[key][res] || 0), 0);
    summary.textContent = `${plural(alive.length, "live node")}; CPUs ${number(sum("available", "CPU"), 3)}`
      + ` free of ${number(sum("total", "CPU"), 3)}; GPUs ${number(sum("available", "GPU"), 3)}`
      + ` free of ${number(sum("total", "GPU"), 3)}.`;
    const names = new Map(c.nodes.map((n) => [n.node_id, n]));
    nodes.replaceChildren(...alive.map((n) => el("tr", { dataset: { nodeId: n.node_id } },
      el("th", { scope: "row", dataset: { label: "Node" } }, el("span", {},
        el("code", {}, nodeName(n)), n.is_head ? el("span", { class: "tag" }, "head") : "")),
      el("td", { dataset: { label: "CPUs" } }, meter("CPUs", n.available.CPU, n.total.CPU)),
      el("td", { dataset: { label: "GPUs" } }, meter("GPUs", n.available.GPU, n.total.GPU)),
      el("td", { dataset: { label: "Workers" } }, n.workers.length
        ? el("ul", { class: "chips" }, n.workers.map((w) => el("li", {},
          el("a", { href: `#/jobs/${w.job_id}` }, w.job_name), ` rank ${w.rank}`)))
        : el("span", { class: "muted" }, "idle")))));
    dead.hidden = gone.length === 0;
    dead.replaceChildren(el("summary", {}, `${plural(gone.length, "dead node")} (not shown above)`),
      el("ul", {}, gone.map((n) => el("li", {}, el("code", {}, nodeName(n))))));
    jobs.replaceChildren(...c.jobs.map((j) => el("tr", { dataset: { jobId: j.id } },
      el("th", { scope: "row", dataset: { label: "Job" } },
        el("a", { href: `#/jobs/${j.id}` }, j.name)),
      el("td", { dataset: { label: "State" } }, stateBadge(j.state)),
      el("td", { dataset: { label: "World size" } }, String(j.world_size)),
      el("td", { dataset: { label: "Workers" } }, Object.keys(j.workers).length
        ? el("ul", { class: "chips" }, Object.entries(j.workers).map(([rank, id]) => {
          const node = names.get(id);
          return el("li", { class: node && !node.alive ? "gone" : null },
            `${rank} → `, el("code", {}, node ? nodeName(node) : id.slice(0, 8)),
            node && !node.alive ? " (dead)" : "");
        }))
        : el("span", { class: "muted" }, "none placed yet")))));
    jobsEmpty.hidden = c.jobs.length > 0;
  }

  function renderQueue(q) {
    queueError.hidden = true;
    const ids = (e) => (e.visible ? { jobId: e.job_id } : {});
    waiting.replaceChildren(...q.queue.map((e) => el("tr",
      { dataset: { position: e.position, ...ids(e) } },
      cells(QUEUE_COLUMNS, [String(e.position), jobCell(e), e.owner ?? "–",
        priorityText(e.priority), e.reason ?? "–"]))));
    waitingEmpty.hidden = q.queue.length > 0;
    const more = q.waiting - q.queue.length;
    waitingMore.textContent = `…and ${more} more waiting behind them.`;
    waitingMore.hidden = more <= 0;
    holders.replaceChildren(...q.running.map((e) => el("tr", { dataset: ids(e) },
      cells(HOLDER_COLUMNS, [jobCell(e), e.owner ?? "–", priorityText(e.priority),
        `${e.size} / ${e.min_workers}..${e.max_workers}`, String(e.borrowed)]))));
    holdersEmpty.hidden = q.running.length > 0;
    const owners = Object.keys(q.quotas).sort((a, b) => (a === "*" ? -1 : b === "*" ? 1
      : a < b ? -1 : 1));
    quotas.replaceChildren(...owners.map((owner) => el("tr", { dataset: { owner } },
      cells(["Owner", "Workers", "GPUs"], [owner === "*" ? "everyone else (default)" : owner,
        limitText(q.quotas[owner].workers, "worker"), limitText(q.quotas[owner].gpus, "GPU")]))));
  }

  async function refreshQueue() {
    try {
      renderQueue(await api("v1/queue", { signal }));
    } catch (err) {
      if (signal.aborted) return;
      queueError.textContent = `Could not read the queue: ${err.message}`;
      queueError.hidden = false;
    }
  }

  (async () => {
    while (!signal.aborted) {
      const queued = refreshQueue(); // its own errors: the nodes still show without it
      try {
        render(await api("v1/cluster", { signal }));
      } catch (err) {
        if (signal.aborted) return;
        summary.textContent = `Could not read the cluster: ${err.message}`;
      }
      await queued;
      await sleep(REFRESH_MS, signal);
    }
  })();
}
