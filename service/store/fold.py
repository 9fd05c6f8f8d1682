"""The event fold: what each stored event changes in its job's summary and checkpoints,
and how event paths are shown (relative to the job)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from elastic.events import COMMANDS_STARTED, EventKind
from elastic.job_state import JobState, check_transition
from service.store.models import CheckpointRow, EventRow, JobRow, MetricRow


def job_relative(path: str, job_id: str) -> str:
    """A checkpoint's path as the API shows it: relative to the job's checkpoint
    directory, which says nothing of where the service keeps its files."""
    marker = f"/{job_id}/"
    at = path.rfind(marker)
    if at >= 0:
        return path[at + len(marker) :]
    return os.path.basename(path.rstrip("/"))


PATH_EVENTS = (
    EventKind.CHECKPOINT_SAVED,
    EventKind.CHECKPOINT_REMOVED,
    EventKind.CHECKPOINT_CORRUPT,
)


def with_relative_paths(job_id: str, events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events with each checkpoint path made relative to the job (see job_relative)."""
    out = []
    for ev in events:
        if ev["kind"] in PATH_EVENTS and isinstance(ev["data"].get("path"), str):
            ev = {**ev, "data": {**ev["data"], "path": job_relative(ev["data"]["path"], job_id)}}
        out.append(ev)
    return out


def event_dict(row: EventRow) -> dict[str, Any]:
    return {"seq": row.seq, "kind": row.kind, "time": row.time, "data": row.data}


def fold(s: Session, job: JobRow, ev: dict[str, Any]) -> None:
    """What one event changes in the job's summary row and the checkpoint table."""
    data, kind = ev["data"], ev["kind"]
    when = datetime.fromtimestamp(ev["time"], UTC)
    if kind == EventKind.STATE:
        previous = JobState(job.state)
        target = check_transition(previous, JobState(data["state"]))
        job.state = target.value
        if data.get("reason") or target.is_terminal:
            job.message = data.get("reason")
        if data.get("world_size"):
            job.world_size = int(data["world_size"])
        if target == JobState.RUNNING and job.started_at is None:
            job.started_at = when
        if target == JobState.QUEUED:  # preempted: it holds no worker until it starts again
            job.world_size = 0
            if previous == JobState.RECOVERING:
                # Held back by the scheduler on its way to a restart: the attempt that
                # restarts it will start from queued, so it is counted here.
                job.restarts += 1
        if target.is_terminal:
            job.finished_at = when
            job.world_size = 0
    elif kind == EventKind.ATTEMPT_STARTED:
        job.world_size = int(data["world_size"])
        # A restart is an attempt that a failure began, as the supervisor counts them
        # against max_restarts. Entries into recovering would miss some: an attempt that
        # fails before its first step leaves the job recovering, and the next one starts
        # with no state event.
        if job.state == JobState.RECOVERING:
            job.restarts += 1
    elif kind == EventKind.METRICS and data.get(COMMANDS_STARTED):
        job.world_size = int(data.get("world_size") or job.world_size)
    elif kind == EventKind.METRICS:
        s.add(
            MetricRow(
                job_id=job.id,
                seq=ev["seq"],
                step=int(data["step"]),
                time=ev["time"],
                loss=data.get("loss"),
                accuracy=data.get("accuracy"),
                samples_per_s=data.get("samples_per_s"),
                learning_rate=data.get("learning_rate"),
                world_size=data.get("world_size"),
            )
        )
        job.step = int(data["step"])
        job.last_loss = data.get("loss")
        job.samples_per_s = data.get("samples_per_s")
        job.total_steps = data.get("total_steps", job.total_steps)
        job.world_size = int(data.get("world_size") or job.world_size)
    elif kind == EventKind.CHECKPOINT_SAVED:
        row = s.get(CheckpointRow, (job.id, int(data["step"])))
        if row is None:
            row = CheckpointRow(job_id=job.id, step=int(data["step"]))
            s.add(row)
        row.path, row.size_bytes = data["path"], int(data["size_bytes"])
        row.created_at, row.removed = float(data["created_at"]), False
    elif kind == EventKind.CHECKPOINT_REMOVED:
        row = s.get(CheckpointRow, (job.id, int(data["step"])))
        if row is not None:
            row.removed = True
