"""How the CLI puts jobs and events into words: one line per event, one row per job."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Any

from elastic.events import EventKind
from elastic_train.models import Event, JobInfo


def plural(n: int | None, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def size(n_bytes: int) -> str:
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def clock(moment: datetime) -> str:
    """The time of day in the user's own time zone."""
    return moment.astimezone().strftime("%H:%M:%S")


def age(moment: datetime, now: float | None = None) -> str:
    """``5s``, ``3m``, ``2h``, ``4d`` ago."""
    seconds = max(0.0, (now or time.time()) - moment.astimezone(UTC).timestamp())
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{int(seconds // span)}{unit}"
    return f"{int(seconds)}s"


def steps(step: int, total: int | None) -> str:
    return f"{step}/{total}" if total else str(step)


def describe(event: Event) -> str:
    """What an event says, in one line (without its number and time)."""
    d, kind = event.data, event.kind
    if kind == EventKind.STATE:
        text = f"state {d.get('state')}"
        if d.get("world_size"):
            text += f" on {plural(d['world_size'], 'worker')}"
        return text + (f": {d['reason']}" if d.get("reason") else "")
    if kind == EventKind.ATTEMPT_STARTED:
        text = f"attempt {d.get('attempt')} started on {plural(d.get('world_size'), 'worker')}"
        if d.get("checkpoint_step") is not None:
            text += f" from the checkpoint of step {d['checkpoint_step']}"
        return text
    if kind == EventKind.METRICS:
        parts = [f"step {steps(int(d.get('step', 0)), d.get('total_steps'))}"]
        parts += [f"loss {number(d.get('loss'))}"]
        if d.get("accuracy") is not None:
            parts.append(f"accuracy {number(d['accuracy'], 3)}")
        if d.get("samples_per_s") is not None:
            parts.append(f"{d['samples_per_s']:.0f} samples/s")
        if d.get("world_size"):
            parts.append(plural(d["world_size"], "worker"))
        return "metrics " + ", ".join(parts)
    if kind == EventKind.WORKER_LOST:
        # Restart mode names the ranks lost; in place, the replicas (its workers' own
        # numbers, as a quorum's ranks change with each quorum).
        if d.get("replicas"):
            who = "replica " + ", ".join(str(r) for r in d["replicas"])
        else:
            who = "rank " + (", ".join(str(r) for r in d.get("ranks") or []) or "?")
        text = f"worker lost: {who} of {plural(d.get('from_world'), 'worker')}"
        if d.get("pause_seconds") is not None:
            text += f", training paused {d['pause_seconds']:.2f} s"
        return text + (f" ({d['reason']})" if d.get("reason") else "")
    if kind in (EventKind.RESIZED, EventKind.RESTORED):
        head = (
            f"resized from {d.get('from_world')} to {plural(d.get('to_world'), 'worker')}"
            if kind == EventKind.RESIZED
            else f"restored the checkpoint of step {d.get('checkpoint_step')}"
        )
        details = []
        if d.get("steps_redone") is not None:
            details.append(f"{plural(d['steps_redone'], 'step')} redone")
        if d.get("recovery_seconds") is not None:
            details.append(f"recovered in {d['recovery_seconds']:.1f} s")
        return head + (f" ({', '.join(details)})" if details else "")
    if kind == EventKind.CHECKPOINT_SAVED:
        return f"checkpoint of step {d.get('step')} saved ({size(int(d.get('size_bytes', 0)))})"
    if kind == EventKind.CHECKPOINT_REMOVED:
        return f"checkpoint of step {d.get('step')} removed"
    if kind == EventKind.CHECKPOINT_CORRUPT:
        return f"checkpoint of step {d.get('step')} is corrupt, skipped: {d.get('reason')}"
    if kind == EventKind.LOG:
        lines = d.get("lines") or []
        return f"log: {plural(len(lines), 'line')} from rank {d.get('rank')}"
    return f"{kind} {json.dumps(d, sort_keys=True)}"


def event_line(event: Event) -> str:
    return f"{event.seq:>5}  {clock(event.time)}  {describe(event)}"


def job_fields(job: JobInfo) -> list[tuple[str, str]]:
    """``etrain status``: the job as label/value pairs."""
    fields = [
        ("id", job.id),
        ("name", job.name),
        ("owner", job.owner),
        ("workload", job.workload),
        ("state", job.state.value),
        ("step", steps(job.step, job.total_steps)),
        ("loss", number(job.last_loss)),
        ("samples/s", "-" if job.samples_per_s is None else f"{job.samples_per_s:.0f}"),
        ("workers", str(job.world_size)),
        ("restarts", str(job.restarts)),
        ("created", job.created_at.isoformat(timespec="seconds")),
    ]
    if job.started_at:
        fields.append(("started", job.started_at.isoformat(timespec="seconds")))
    if job.finished_at:
        fields.append(("finished", job.finished_at.isoformat(timespec="seconds")))
    if job.message:
        fields.append(("message", job.message))
    return fields


def json_text(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)
