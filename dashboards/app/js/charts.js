// Line charts on uPlot (installed from npm, served from node_modules), sized to their
// container, with event markers that are real buttons: hover or focus shows the event.
import uPlot from "../vendor/uplot/uPlot.esm.js";
import { clock } from "./format.js";

const COLORS = { loss: "#c2410c", accuracy: "#2563eb", rate: "#0f766e", world: "#7c3aed" };
export const MARKER_COLORS = { worker_lost: "#dc2626", resized: "#d97706", restored: "#16a34a" };
const HEIGHT = 220;

function markerPlugin(getMarkers) {
  return {
    hooks: {
      draw: [(u) => {
        const { ctx, bbox } = u;
        ctx.save();
        ctx.setLineDash([4 * devicePixelRatio, 3 * devicePixelRatio]);
        ctx.lineWidth = devicePixelRatio;
        for (const m of getMarkers()) {
          const x = Math.round(u.valToPos(m.x, "x", true));
          if (x < bbox.left || x > bbox.left + bbox.width) continue;
          ctx.strokeStyle = MARKER_COLORS[m.kind] || "#64748b";
          ctx.beginPath();
          ctx.moveTo(x, bbox.top);
          ctx.lineTo(x, bbox.top + bbox.height);
          ctx.stroke();
        }
        ctx.restore();
        placeMarkerButtons(u, getMarkers());
      }],
    },
  };
}

function placeMarkerButtons(u, markers) {
  let layer = u.root.querySelector(".markers");
  if (!layer) {
    layer = document.createElement("div");
    layer.className = "markers";
    u.over.append(layer);
  }
  layer.replaceChildren();
  const width = u.over.clientWidth;
  let lastLeft = -Infinity;
  let stack = 0;
  markers.forEach((m) => {
    const left = u.valToPos(m.x, "x");
    if (left < 0 || left > width) return;
    // Events within a few pixels of each other (a resize and its restore) stack downwards.
    stack = left - lastLeft < 14 ? stack + 1 : 0;
    lastLeft = left;
    const button = document.createElement("button");
    button.type = "button";
    button.className = `marker marker-${m.kind}`;
    button.dataset.kind = m.kind;
    button.style.left = `${left}px`;
    button.style.top = `${stack * 20 - 2}px`;
    button.style.setProperty("--marker", MARKER_COLORS[m.kind] || "#64748b");
    button.setAttribute("aria-label", `${m.label} at ${clock(m.x)}`);
    const tip = document.createElement("span");
    tip.className = "tip";
    tip.setAttribute("role", "tooltip");
    tip.textContent = `${clock(m.x)} · ${m.label}`;
    if (left > width / 2) tip.classList.add("tip-left");
    button.append(tip);
    layer.append(button);
  });
}

// A chart in `container`; update(data) replaces its columns ([x, y1, y2...]).
export function lineChart(container, { xTime, series, axes, markers, stepped = false }) {
  const empty = document.createElement("p");
  empty.className = "chart-empty";
  empty.textContent = "No data yet";
  container.append(empty);
  const opts = {
    width: Math.max(container.clientWidth, 200),
    height: HEIGHT,
    scales: { x: { time: xTime } },
    cursor: { drag: { x: true, y: false } },
    legend: { live: true },
    series: [
      { label: xTime ? "time" : "step", value: xTime ? (u, v) => clock(v) : undefined },
      ...series.map((s) => ({
        spanGaps: true,
        width: 2,
        stroke: COLORS[s.color],
        points: { show: false },
        paths: stepped ? uPlot.paths.stepped({ align: 1 }) : undefined,
        ...s,
      })),
    ],
    axes: axes || [{}, {}],
    plugins: markers ? [markerPlugin(markers)] : [],
  };
  const data = [[], ...series.map(() => [])];
  const chart = new uPlot(opts, data, container);
  container.chart = chart; // for tests and the console
  const resize = new ResizeObserver(() => {
    const width = Math.max(container.clientWidth, 200);
    if (width !== chart.width) chart.setSize({ width, height: HEIGHT });
  });
  resize.observe(container);
  return {
    chart,
    update(columns) {
      chart.setData(columns);
      const n = columns[0].length;
      container.dataset.points = String(n);
      empty.hidden = n > 0;
    },
    redraw() {
      chart.redraw(false, false);
    },
    destroy() {
      resize.disconnect();
      chart.destroy();
    },
  };
}
