"""``etrain submit --follow``: a live progress bar (steps of total, loss, samples/s, world
size, ETA), with each state change, resize and recovery printed as a line above it. Off a
terminal (CI logs) the same lines are printed, with a metrics line every tenth of the run."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from elastic_train.models import Event, JobInfo
from elastic_train.render import clock, describe, number

if TYPE_CHECKING:
    from rich.console import Console

# Printed above the bar as they happen; metrics only move the bar.
NEWS = frozenset(
    {"state", "attempt_started", "worker_lost", "resized", "restored", "checkpoint_corrupt"}
)
FOLLOWED_KINDS = (*sorted(NEWS), "metrics")
PLAIN_METRICS_EVERY_S = 10.0


class FollowView:
    def __init__(self, console: Console, job: JobInfo) -> None:
        self.console = console
        self.live = console.is_terminal and not console.is_dumb_terminal
        self.job = job
        self.state = job.state.value
        self._plain_mark = -1
        self._plain_at = 0.0
        self.progress = None
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]{task.fields[state]:<10}"),
                BarColumn(),
                TextColumn("step {task.fields[steps]}"),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[speed]} samples/s"),
                TextColumn("{task.fields[world]} workers"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.progress.add_task(
                job.name,
                total=job.total_steps,
                completed=job.step,
                state=self.state,
                steps=f"{job.step}/{job.total_steps or '?'}",
                loss=number(job.last_loss),
                speed="-" if job.samples_per_s is None else f"{job.samples_per_s:.0f}",
                world=job.world_size,
            )

    def __enter__(self) -> FollowView:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def show(self, event: Event) -> None:
        if event.kind == "state":
            self.state = str(event.data.get("state"))
        if event.kind in NEWS:
            self._line(event)
        if self.progress is not None:
            self._update_bar(event)
        elif event.kind == "metrics":
            self._plain_metrics(event)

    def _update_bar(self, event: Event) -> None:
        assert self.progress is not None
        d = event.data
        if event.kind == "metrics":
            step, total = int(d.get("step", 0)), d.get("total_steps")
            speed = d.get("samples_per_s")
            self.progress.update(
                self.task,
                completed=step,
                total=total,
                steps=f"{step}/{total or '?'}",
                loss=number(d.get("loss")),
                speed="-" if speed is None else f"{speed:.0f}",
                world=d.get("world_size") or "-",
                state=self.state,
            )
        elif event.kind in ("state", "attempt_started", "resized"):
            world = d.get("world_size") or d.get("to_world")
            if world:
                self.progress.update(self.task, state=self.state, world=world)
            else:
                self.progress.update(self.task, state=self.state)

    def _plain_metrics(self, event: Event) -> None:
        step, total = int(event.data.get("step", 0)), event.data.get("total_steps")
        now = time.monotonic()
        if total:
            mark = step * 10 // int(total)
            if mark <= self._plain_mark:
                return
            self._plain_mark = mark
        elif now - self._plain_at < PLAIN_METRICS_EVERY_S:
            return
        self._plain_at = now
        self._line(event)

    def _line(self, event: Event) -> None:
        self.console.print(
            f"{clock(event.time)}  {describe(event)}", highlight=False, soft_wrap=True, markup=False
        )
