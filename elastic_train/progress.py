"""``etrain submit --follow``: a live progress bar (steps of total, loss, samples/s, world
size, ETA; before the job's first step, what it waits for), with each state change, resize
and recovery printed as a line above it. Off a terminal (CI logs) the same lines are
printed, with a metrics line every tenth of the run."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from elastic.events import EventKind
from elastic_train.models import Event, JobInfo
from elastic_train.render import clock, describe, number, plural, steps

if TYPE_CHECKING:
    from rich.console import Console

# Printed above the bar as they happen; metrics only move the bar.
NEWS = frozenset(
    {
        EventKind.STATE,
        EventKind.ATTEMPT_STARTED,
        EventKind.WORKER_LOST,
        EventKind.RESIZED,
        EventKind.RESTORED,
        EventKind.CHECKPOINT_CORRUPT,
    }
)
FOLLOWED_KINDS = (*sorted(NEWS), EventKind.METRICS)
PLAIN_METRICS_EVERY_S = 10.0


class FollowView:
    def __init__(self, console: Console, job: JobInfo) -> None:
        self.console = console
        self.live = console.is_terminal and not console.is_dumb_terminal
        self.job = job
        self.state = job.state.value
        self.world = job.world_size
        # Until the job's first step there is no step, total, loss or speed to show.
        self.stepped = job.step > 0 or job.total_steps is not None
        self._plain_mark = -1
        self._plain_at = 0.0
        self.progress = None
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]{task.fields[state]:<10}"),
                BarColumn(),
                TextColumn("{task.fields[detail]}", markup=False),
                TextColumn("{task.fields[eta]}"),
                TimeRemainingColumn(),
                console=console,
            )
            detail = (
                step_detail(
                    job.step, job.total_steps, job.last_loss, job.samples_per_s, job.world_size
                )
                if self.stepped
                else waiting_detail(self.state, self.world)
            )
            self.task = self.progress.add_task(
                job.name,
                total=job.total_steps,
                completed=job.step,
                state=self.state,
                detail=detail,
                eta="ETA" if job.total_steps else "",
            )

    def __enter__(self) -> FollowView:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def show(self, event: Event) -> None:
        if event.kind == EventKind.STATE:
            self.state = str(event.data.get("state"))
        if event.kind in NEWS:
            self._line(event)
        if self.progress is not None:
            self._update_bar(event)
        elif event.kind == EventKind.METRICS:
            self._plain_metrics(event)

    def _update_bar(self, event: Event) -> None:
        assert self.progress is not None
        d = event.data
        if event.kind == EventKind.METRICS:
            self.stepped = True
            step, total = int(d.get("step", 0)), d.get("total_steps")
            self.world = d.get("world_size") or self.world
            self.progress.update(
                self.task,
                completed=step,
                total=total,
                detail=step_detail(
                    step, total, d.get("loss"), d.get("samples_per_s"), d.get("world_size")
                ),
                eta="ETA" if total else "",
                state=self.state,
            )
        elif event.kind in (EventKind.STATE, EventKind.ATTEMPT_STARTED, EventKind.RESIZED):
            self.world = d.get("world_size") or d.get("to_world") or self.world
            if self.stepped:
                self.progress.update(self.task, state=self.state)
            else:
                self.progress.update(
                    self.task, state=self.state, detail=waiting_detail(self.state, self.world)
                )

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


def step_detail(
    step: int, total: int | None, loss: float | None, speed: float | None, world: int | None
) -> str:
    """What the bar says of a job that has made steps."""
    rate = "-" if speed is None else f"{speed:.0f}"
    return f"step {steps(step, total)} loss {number(loss)} {rate} samples/s {world or '-'} workers"


def waiting_detail(state: str, world: int) -> str:
    """What the bar says before the job's first step: what it is waiting for."""
    if state == "queued":
        return "waiting in the queue"
    return "waiting for the first step" + (f" on {plural(world, 'worker')}" if world else "")
