"""The recovery bench's runs as a picture: optimizer step against seconds since the kill,
one panel per side, each side drawn from one representative run.

    .venv/bin/python -m bench.recovery_plot <work dir> --out docs/img/recovery.png

``<work dir>`` is the directory ``bench.recovery`` prints, holding
``<side>-<repetition>/records.json``; ``bench.recovery --plot PATH`` draws the same figure
at the end of its runs.

The representative run of a side is the one whose "kill to first step at the smaller size"
(``recovery_s``, the table's first row, from ``bench.recovery_records.summarize``) is the
median of the side's runs; with an even number of runs, the lower of the middle two.

Layout: one panel per side, stacked, in one PNG 1300 px wide. Each panel has its own x
scale, from a little before the kill to a little after the first step at the bigger size
once the node is back (or the run's end): stock Ray Train takes about 70 s to recover and
70 s more to grow, ours well under 2 s and a few seconds, so on one shared time axis the
fast sides' recoveries would be a few pixels wide. A broken axis would keep a common scale
around the kill but cut each slow side's pause, the very thing the picture is for. The
titles carry each side's recovery time, so the numbers compare where the scales do not.
The y axis (optimizer step) is each panel's own too: with the time axes not shared, a
shared step axis would compare nothing, and would squeeze the panels whose window holds
fewer steps. Hundreds of steps still hide the few that a kill
throws away or redoes, so each panel has an inset, "zoom on the recovery", from just before
the kill to just after the first step at the smaller size, its step axis fitted to the
steps up to that one; it sits in the panel's upper left (empty while the steps climb from
the left), or its lower right if fewer steps lie there.

Each panel shows:
- the steps of the final model (``bench.recovery_records.lineage``), a point per step
  coloured by the world size that trained it, joined by a thin line;
- steps trained by an attempt that a restart then lost (its steps were done again), as
  hollow markers; steps tried and thrown away (not committed), as crosses;
- the kill (solid vertical line, t = 0), the span from the kill to the first step at the
  smaller size (shaded), and the node added back (dashed vertical line).
Ours in place records committed steps only (the job reports no thrown-away try), so its
panel has no crosses. A replica that trained the job again alone after it had ended
(``split-brain:`` attempts) is left out, as the summary leaves it out of every figure but
its count.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from bench.recovery_records import HEADERS, SIDES, StepRecord, lineage, summarize

WIDTH_IN, DPI = 13.0, 100  # 1300 px: a GitHub page shows it at its column's width
PANEL_IN = 2.4  # height per side
BEFORE_S = 2.0  # the least shown before the kill
# Colour by world size: the starting 3 workers, the 2 left after the kill, then 1 and 4+.
WORLD_COLOURS = ["tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple", "tab:brown"]
SPLIT_BRAIN = "split-brain:"
# The zoom on the recovery in a panel: upper left, else lower right (fractions of the panel).
INSETS = [(0.035, 0.4, 0.3, 0.5), (0.665, 0.08, 0.3, 0.5)]


@dataclass(frozen=True)
class Run:
    """One run's records and the times the panel is laid out by (wall clock)."""

    path: Path
    records: list[StepRecord]
    killed_at: float
    added_at: float | None
    recovery_s: float  # kill to the first committed step at the smaller size
    grown_at: float | None  # the first committed step at the bigger size, once a node is back


@dataclass(frozen=True)
class Point:
    """One step of one attempt (its ranks' records are one point, at the first's time)."""

    time: float
    step: int
    world: int
    # kept: in the final model; lost: its attempt was lost, the step redone by a later one;
    # thrown: tried and not committed
    kind: Literal["kept", "lost", "thrown"]


def load(path: Path) -> Run:
    """A run from the ``records.json`` bench.recovery wrote."""
    data = json.loads(path.read_text())
    records = [
        StepRecord(t, rank, step, str(attempt), world, bool(committed), tuple(indices))
        for t, rank, step, attempt, world, committed, indices in data["records"]
    ]
    killed_at, added_at = data["killed_at"], data["added_at"]
    # The table's own figures. The last committed step stands in for the job's step count
    # and the batch is any: they only feed figures not used here (wall time, samples).
    last = max(r.step for r in records if r.committed and not r.attempt.startswith(SPLIT_BRAIN))
    figures = summarize(records, data["started"], killed_at, added_at, last, 1)
    grown_at = (
        added_at + figures["grow_s"] if added_at is not None and "grow_s" in figures else None
    )
    return Run(path, records, killed_at, added_at, figures["recovery_s"], grown_at)


def representative(runs: Sequence[Run]) -> Run:
    """The run whose kill-to-first-step-at-the-smaller-size is the median of ``runs``; the
    lower middle one of an even number, the first given of equal ones."""
    middle = sorted(r.recovery_s for r in runs)[(len(runs) - 1) // 2]
    return next(r for r in runs if r.recovery_s == middle)


def points(run: Run) -> list[Point]:
    """A point per (attempt, step, committed), time-ordered."""
    records = [r for r in run.records if not r.attempt.startswith(SPLIT_BRAIN)]
    kept = {(r.attempt, r.step) for r in lineage(records)}
    first: dict[tuple[str, int, bool], StepRecord] = {}
    for r in sorted(records, key=lambda r: r.time):
        first.setdefault((r.attempt, r.step, r.committed), r)
    out = [
        Point(
            r.time,
            r.step,
            r.world,
            "thrown" if not r.committed else "kept" if (r.attempt, r.step) in kept else "lost",
        )
        for r in first.values()
    ]
    return sorted(out, key=lambda p: p.time)


def window(run: Run, shown: list[Point]) -> tuple[float, float]:
    """The panel's x range in seconds since the kill: from a tenth of what follows before
    the kill (at least BEFORE_S, but not much before the first step) to a tenth after the
    first step at the bigger size (the last step when the job did not grow)."""
    end = (run.grown_at if run.grown_at is not None else shown[-1].time) - run.killed_at
    start = shown[0].time - run.killed_at
    pad = 0.1 * end
    return max(start - 0.02 * end, -max(BEFORE_S, pad)), end + max(pad, 0.3)


def plot(
    runs: Mapping[str, Sequence[Path]], out: Path, headers: Mapping[str, str] = HEADERS
) -> dict[str, Path]:
    """Draw each side's representative run of ``runs`` (side -> its records.json files, in
    the order of the panels) into the PNG ``out``; returns the records.json drawn per side."""
    chosen = {side: representative([load(p) for p in paths]) for side, paths in runs.items()}
    drawn = {side: points(run) for side, run in chosen.items()}
    worlds = sorted({p.world for ps in drawn.values() for p in ps}, reverse=True)
    colour = {w: WORLD_COLOURS[i % len(WORLD_COLOURS)] for i, w in enumerate(worlds)}

    fig = Figure(figsize=(WIDTH_IN, 1.1 + PANEL_IN * len(chosen)), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(chosen), 1, squeeze=False)[:, 0]
    for ax, (side, run) in zip(axes, chosen.items(), strict=True):
        _panel(ax, run, drawn[side], colour)
        count = len(runs[side])
        which = f"median of {count} runs" if count > 1 else "its one run"
        ax.set_title(
            f"{headers.get(side, side)}: kill to first step at the smaller size: "
            f"{run.recovery_s:.2f} s   ({which}: {run.path.parent.name})",
            loc="left",
            fontsize=11,
        )
    fig.supxlabel("seconds since the kill (each panel on its own scale)")
    fig.supylabel("optimizer step")
    fig.legend(
        handles=_legend(worlds, colour),
        loc="outside upper center",
        ncol=5,
        frameon=False,
        fontsize=10,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return {side: run.path for side, run in chosen.items()}


def _panel(ax: Axes, run: Run, shown: list[Point], colour: dict[int, str]) -> None:
    """The run from before the kill to after the grow, and an inset on the recovery."""
    _draw(ax, run, shown, colour, 1.0)
    left, right = window(run, shown)
    _frame(ax, run, shown, (left, right), right)
    zoom = ax.inset_axes(_corner(ax, run, shown))
    _draw(zoom, run, shown, colour, 1.6)
    # From a little before the kill to a little after the first step at the smaller size;
    # its steps are those up to that first one, where the steps thrown away or redone lie
    # (the steps after it leave through the top).
    span = max(run.recovery_s, 0.2)
    xlim = (max(-0.2 * span, left), min(1.25 * span, right))
    _frame(zoom, run, shown, xlim, run.recovery_s, margin=3.0)
    zoom.set_title("zoom on the recovery", fontsize=8, pad=2)
    zoom.tick_params(labelsize=7, pad=1)
    ax.indicate_inset_zoom(zoom, edgecolor="0.55")


def _corner(ax: Axes, run: Run, shown: list[Point]) -> tuple[float, float, float, float]:
    """Where the inset goes (x, y, width, height in the panel's fractions): the upper left,
    empty while the steps climb from the left, unless fewer steps lie under the lower
    right; the inset hides what it covers."""
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()

    def under(box: tuple[float, float, float, float]) -> int:
        left, bottom, width, height = box
        return sum(
            left <= (p.time - run.killed_at - x0) / (x1 - x0) <= left + width
            and bottom <= (p.step - y0) / (y1 - y0) <= bottom + height
            for p in shown
        )

    return min(INSETS, key=under)


def _frame(
    ax: Axes,
    run: Run,
    shown: list[Point],
    xlim: tuple[float, float],
    fit_to: float,
    margin: float = 1.0,
) -> None:
    """Limits: ``xlim`` (seconds since the kill), and the steps drawn from its left end to
    ``fit_to``, ``margin`` steps or a twentieth more on either side."""
    steps = [p.step for p in shown if xlim[0] <= p.time - run.killed_at <= fit_to] or [0]
    pad = max(margin, 0.05 * (max(steps) - min(steps)))
    ax.set_xlim(*xlim)
    ax.set_ylim(min(steps) - pad, max(steps) + pad)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))


def _draw(ax: Axes, run: Run, shown: list[Point], colour: dict[int, str], scale: float) -> None:
    at = run.killed_at
    ax.axvspan(0, run.recovery_s, color="0.88", zorder=0)
    ax.axvline(0, color="black", linewidth=1.3, zorder=1)
    if run.added_at is not None:
        ax.axvline(run.added_at - at, color="black", linestyle="--", linewidth=1.1, zorder=1)
    kept = [p for p in shown if p.kind == "kept"]
    ax.plot([p.time - at for p in kept], [p.step for p in kept], color="0.6", lw=0.8, zorder=2)
    for kind, style in (
        ("kept", {"marker": "o", "s": 12 * scale}),
        ("lost", {"marker": "o", "s": 26 * scale, "facecolors": "none", "linewidths": 1.0}),
        ("thrown", {"marker": "x", "s": 36 * scale, "linewidths": 1.3}),
    ):
        these = [p for p in shown if p.kind == kind]
        if not these:
            continue
        colours = [colour[p.world] for p in these]
        paint = {"edgecolors": colours} if kind == "lost" else {"c": colours}
        ax.scatter(
            [p.time - at for p in these],
            [p.step for p in these],
            zorder=3,
            **paint,
            **style,  # type: ignore[arg-type]
        )
    ax.grid(True, color="0.92", linewidth=0.6)
    ax.set_axisbelow(True)


def _legend(worlds: list[int], colour: dict[int, str]) -> list[Line2D | Patch]:
    def dot(label: str, **kw: object) -> Line2D:
        return Line2D([], [], linestyle="none", label=label, **kw)  # type: ignore[arg-type]

    return [
        *(
            dot(f"{w} worker{'s' if w > 1 else ''}", marker="o", color=colour[w], markersize=6)
            for w in worlds
        ),
        dot("a step of the final model", marker="o", color="0.4", markersize=5),
        dot(
            "trained, then redone after a restart",
            marker="o",
            markerfacecolor="none",
            markeredgecolor="0.4",
            markersize=7,
        ),
        dot("tried, thrown away", marker="x", color="0.4", markersize=7, markeredgewidth=1.3),
        Line2D([], [], color="black", linewidth=1.3, label="node killed"),
        Patch(color="0.88", label="kill to first step at the smaller size"),
        Line2D([], [], color="black", linestyle="--", linewidth=1.1, label="node added back"),
    ]


def find_runs(work: Path) -> dict[str, list[Path]]:
    """``<work>/<side>-<repetition>/records.json``, per side: the sides in bench.recovery's
    order (any other after them, by name), each side's runs by repetition."""
    found: dict[str, list[tuple[int, Path]]] = {}
    for path in work.glob("*/records.json"):
        match = re.fullmatch(r"(.+)-(\d+)", path.parent.name)
        if match:
            found.setdefault(match[1], []).append((int(match[2]), path))
    order = [s for s in SIDES if s in found] + sorted(set(found) - set(SIDES))
    return {side: [p for _, p in sorted(found[side])] for side in order}


def draw(work: Path, out: Path) -> dict[str, Path]:
    """What the command does: every run under ``work`` into ``out``; the runs drawn."""
    runs = find_runs(work)
    if not runs:
        raise FileNotFoundError(f"no <side>-<repetition>/records.json under {work}")
    return plot(runs, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("work", type=Path, help="the directory bench.recovery printed")
    parser.add_argument("--out", type=Path, default=Path("docs/img/recovery.png"))
    args = parser.parse_args()
    for side, path in draw(args.work, args.out).items():
        print(f"{side}: {path}")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
