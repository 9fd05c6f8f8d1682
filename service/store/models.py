"""The store's tables, and the columns a page of the jobs list reads."""

from __future__ import annotations

import hashlib
import secrets
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from elastic.events import EventKind


class Base(DeclarativeBase):
    pass


def utcnow() -> datetime:
    return datetime.now(UTC)


class JobRow(Base):
    __tablename__ = "jobs"
    # An owner's live jobs (the quota check of every submission): with the owner index
    # alone, SQLite walked all of a busy owner's 10 000 ended jobs to find the few live ones.
    __table_args__ = (Index("ix_jobs_owner_state", "owner", "state"),)

    # Time-ordered ids: newest first is a descending sort on the key alone.
    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(128))
    owner: Mapped[str] = mapped_column(String(128), index=True)
    workload: Mapped[str] = mapped_column(String(256))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(16), index=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    world_size: Mapped[int] = mapped_column(Integer, default=0)
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)
    last_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    last_seq: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    @property
    def min_workers(self) -> int:
        return int(self.spec["scaling"]["min_workers"])

    @property
    def max_workers(self) -> int:
        return int(self.spec["scaling"]["max_workers"])

    @property
    def priority(self) -> int | str | None:
        """The spec's priority as submitted (a class name or a number; None before there
        were priorities)."""
        value: int | str | None = self.spec.get("priority")
        return value


# What a page of the jobs list carries: the table's columns, the spec's worker bounds read in
# the database, never the whole spec (decoding 50 specs' JSON a page was most of its time).
SUMMARY_COLUMNS = (
    JobRow.id,
    JobRow.name,
    JobRow.owner,
    JobRow.workload,
    JobRow.state,
    JobRow.message,
    JobRow.world_size,
    JobRow.spec["scaling"]["min_workers"].as_integer().label("min_workers"),
    JobRow.spec["scaling"]["max_workers"].as_integer().label("max_workers"),
    JobRow.spec["priority"].label("priority"),  # a name or a number: the schema reads it
    JobRow.step,
    JobRow.total_steps,
    JobRow.last_loss,
    JobRow.samples_per_s,
    JobRow.restarts,
    JobRow.created_at,
    JobRow.updated_at,
    JobRow.started_at,
    JobRow.finished_at,
)


class EventRow(Base):
    __tablename__ = "job_events"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    kind: Mapped[str] = mapped_column(String(32))
    time: Mapped[float] = mapped_column(Float)
    data: Mapped[dict[str, Any]] = mapped_column(JSON)


class MetricRow(Base):
    """The metrics events again, as a narrow table: series queries stay cheap on long runs."""

    __tablename__ = "metrics"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    time: Mapped[float] = mapped_column(Float)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    accuracy: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples_per_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    learning_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    world_size: Mapped[int | None] = mapped_column(Integer, nullable=True)


# Most points one metrics request returns, whatever it asks: the work of a request is
# bounded however long the run.
MAX_METRIC_POINTS = 100_000
# What retention deletes from a finished job: the series and the log, not its history.
PURGED_KINDS = (EventKind.METRICS, EventKind.LOG)

METRIC_COLUMNS = (
    "step",
    "time",
    "loss",
    "accuracy",
    "samples_per_s",
    "learning_rate",
    "world_size",
)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Float)
    removed: Mapped[bool] = mapped_column(Boolean, default=False)


class UserRow(Base):
    __tablename__ = "users"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class TokenRow(Base):
    """An API token. Only the SHA-256 of its secret is kept: the secret is shown once."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    user: Mapped[str] = mapped_column(ForeignKey("users.name"), index=True)
    label: Mapped[str] = mapped_column(String(128))
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class UserLimitRow(Base):
    """An admin's limits for one user; a None column means the service's default."""

    __tablename__ = "user_limits"

    user: Mapped[str] = mapped_column(ForeignKey("users.name"), primary_key=True)
    max_active_jobs: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_workers: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_cpus: Mapped[float | None] = mapped_column(Float, nullable=True)
    max_gpus: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_wall_time_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    code_submission: Mapped[bool | None] = mapped_column(Boolean, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


LIMIT_COLUMNS = (
    "max_active_jobs",
    "max_workers",
    "max_cpus",
    "max_gpus",
    "max_wall_time_s",
    "code_submission",
)


class IdempotencyRow(Base):
    """A submission's Idempotency-Key; ``job_id`` is None while it is being processed."""

    __tablename__ = "idempotency_keys"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    fingerprint: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id"), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_job_id() -> str:
    return f"job-{time.time_ns() // 1_000_000:012x}{secrets.token_hex(4)}"
