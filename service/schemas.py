"""What the API returns."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from jobs.state import JobState


class JobOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    owner: str
    workload: str
    state: JobState
    message: str | None
    world_size: int
    step: int
    total_steps: int | None
    last_loss: float | None
    samples_per_s: float | None
    restarts: int
    spec: dict[str, Any]
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None


class JobPage(BaseModel):
    items: list[JobOut]
    next_cursor: str | None


class EventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    seq: int
    kind: str
    time: float
    data: dict[str, Any]


class EventPage(BaseModel):
    items: list[EventOut]
    next_after: int


class CheckpointOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    path: str
    size_bytes: int
    created_at: float


class CheckpointList(BaseModel):
    items: list[CheckpointOut]
