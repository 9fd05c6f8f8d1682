"""What the API returns, as the client reads it.

The service's own response models live in ``service/schemas.py``; the client keeps its
own copies so that it never imports the service (FastAPI, Ray) at start-up.
``tests/unit/elastic_train/test_cli_units.py`` checks that the two agree field for field.
Unknown fields from a newer service are ignored.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from elastic.events import EventKind
from elastic.job_state import JobState


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class JobInfo(_Answer):
    """One job as ``GET /v1/jobs/{id}`` answers it; a page of ``GET /v1/jobs`` carries the
    same without the spec (``spec`` is None there: fetch the job for it)."""

    id: str
    name: str
    owner: str
    workload: str
    state: JobState
    message: str | None
    world_size: int
    min_workers: int | None = None
    max_workers: int | None = None
    priority: int | None = None  # the spec's, as a number (None from an older service)
    step: int
    total_steps: int | None
    last_loss: float | None
    samples_per_s: float | None
    restarts: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    spec: dict[str, Any] | None = None


class Event(_Answer):
    """One entry of a job's event log: ``seq`` is dense from 1, ``time`` when it happened
    (UTC)."""

    seq: int
    kind: str
    time: datetime
    data: dict[str, Any]

    @property
    def is_terminal(self) -> bool:
        """The job's last event: its move to succeeded, failed or cancelled."""
        if self.kind != EventKind.STATE:
            return False
        try:
            return JobState(str(self.data.get("state"))).is_terminal
        except ValueError:
            return False


class Checkpoint(_Answer):
    step: int
    path: str
    size_bytes: int
    created_at: datetime


class LogLine(_Answer):
    seq: int
    rank: int
    attempt: int
    time: datetime
    stream: str
    line: str


class MetricSeries(_Answer):
    total_points: int
    # ``time`` holds ISO 8601 strings, the other columns numbers.
    columns: dict[str, list[float | int | str | None]]


class Limits(_Answer):
    """A user's limits as the service applies them; None: no limit."""

    max_active_jobs: int
    max_workers: int | None = None
    max_cpus: float | None = None
    max_gpus: int | None = None
    max_wall_time_s: float | None = None
    code_submission: bool = True


class Me(_Answer):
    user: str
    role: str
    limits: Limits | None = None


def log_lines(event: Event) -> list[LogLine]:
    """The lines one ``log`` event carries (``data.lines`` holds [time, stream, text], the
    time in ISO 8601)."""
    data = event.data
    return [
        LogLine(
            seq=event.seq,
            rank=int(data["rank"]),
            attempt=int(data["attempt"]),
            time=datetime.fromisoformat(str(t)),
            stream=str(stream),
            line=str(text),
        )
        for t, stream, text in data.get("lines", [])
    ]


def metric_point(event: Event) -> dict[str, Any]:
    """A ``metrics`` event as one dict: its time (a datetime, UTC) and what the job reported
    (step, loss, accuracy, samples_per_s, learning_rate, world_size, total_steps, ...)."""
    return {"time": event.time, **event.data}
