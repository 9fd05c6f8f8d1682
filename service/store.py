"""The store: jobs, their event log and checkpoints, through SQLAlchemy 2 (SQLite or PostgreSQL)."""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    create_engine,
    delete,
    event,
    func,
    inspect,
    or_,
    select,
)
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from jobs.state import TERMINAL_STATES, JobState, check_transition


class Base(DeclarativeBase):
    pass


def utcnow() -> datetime:
    return datetime.now(UTC)


class JobRow(Base):
    __tablename__ = "jobs"

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
PURGED_KINDS = ("metrics", "log")

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
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


LIMIT_COLUMNS = ("max_active_jobs", "max_workers", "max_cpus", "max_gpus", "max_wall_time_s")


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


@dataclass(frozen=True)
class Page:
    # Rows of SUMMARY_COLUMNS (attribute access, as a JobRow), without the spec.
    items: list[Any]
    next_cursor: str | None


def encode_cursor(job_id: str) -> str:
    return base64.urlsafe_b64encode(job_id.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    try:
        value = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except ValueError as e:
        raise ValueError("cursor is not one this service gave out") from e
    if not value.startswith("job-"):
        raise ValueError("cursor is not one this service gave out")
    return value


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer elastic-train than this one."""


MIGRATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")


def migrate(engine: Engine) -> None:
    """Bring the schema to this version's head with Alembic; refuse a newer one."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", MIGRATIONS)
    scripts = ScriptDirectory.from_config(config)
    with engine.begin() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
        if current is not None and current not in {s.revision for s in scripts.walk_revisions()}:
            raise SchemaTooNew(
                f"the database at {engine.url.render_as_string(hide_password=True)} has schema "
                f"revision {current!r}, newer than this elastic-train knows (its newest is "
                f"{scripts.get_current_head()!r}); upgrade elastic-train or use another database"
            )
        config.attributes["connection"] = conn
        if current is None and inspect(conn).has_table("jobs"):
            # Made by the walking skeleton's create_all, before migrations existed.
            command.stamp(config, "0001")
        command.upgrade(config, "head")


class Store:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = _make_engine(url)
        migrate(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions.begin() as s:
            yield s

    # -- jobs ---------------------------------------------------------------------------

    def create_job(
        self,
        name: str,
        owner: str,
        workload: str,
        spec: dict[str, Any],
        idempotency_key: str | None = None,
    ) -> JobRow:
        """A new queued job; with ``idempotency_key`` (claimed before), the key records the
        job in the same transaction, so a crash leaves no job without its key."""
        now = utcnow()
        job = JobRow(
            id=new_job_id(),
            name=name,
            owner=owner,
            workload=workload,
            spec=spec,
            state=JobState.QUEUED.value,
            world_size=0,
            step=0,
            restarts=0,
            last_seq=1,
            created_at=now,
            updated_at=now,
        )
        with self.session() as s:
            s.add(job)
            s.flush()  # the job row must exist before its first event refers to it
            s.add(
                EventRow(
                    job_id=job.id,
                    seq=1,
                    kind="state",
                    time=now.timestamp(),
                    data={"state": JobState.QUEUED.value, "previous": None, "reason": None},
                )
            )
            if idempotency_key is not None:
                held = s.get(IdempotencyRow, (owner, idempotency_key))
                if held is not None:
                    held.job_id = job.id
        return job

    def get_job(self, job_id: str) -> JobRow | None:
        with self.session() as s:
            return s.get(JobRow, job_id)

    def list_jobs(
        self, state: JobState | None, limit: int, cursor: str | None, owner: str | None = None
    ) -> Page:
        """Newest first; only ``owner``'s jobs when given."""
        query = select(*SUMMARY_COLUMNS).order_by(JobRow.id.desc()).limit(limit + 1)
        if owner is not None:
            query = query.where(JobRow.owner == owner)
        if state is not None:
            query = query.where(JobRow.state == state.value)
        if cursor:
            query = query.where(JobRow.id < decode_cursor(cursor))
        with self.engine.connect() as conn:
            rows = list(conn.execute(query))
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(rows, encode_cursor(rows[-1].id) if more and rows else None)

    def active_jobs(self, owner: str | None = None) -> list[JobRow]:
        """Jobs not yet ended; only ``owner``'s when given."""
        # IN the live states, not NOT IN the ended ones: the state index finds the few live
        # jobs among 10 000 ended ones instead of a scan (a profile under load showed it).
        live = [s.value for s in JobState if s not in TERMINAL_STATES]
        query = select(JobRow).where(JobRow.state.in_(live))
        if owner is not None:
            query = query.where(JobRow.owner == owner)
        with self.session() as s:
            return list(s.scalars(query))

    # -- users and tokens ---------------------------------------------------------------

    def ensure_user(self, name: str, role: str) -> UserRow:
        with self.session() as s:
            user = s.get(UserRow, name)
            if user is None:
                user = UserRow(name=name, role=role, created_at=utcnow())
                s.add(user)
            return user

    def create_user(self, name: str, role: str) -> UserRow | None:
        """The new user, or None when the name is taken."""
        try:
            with self.session() as s:
                user = UserRow(name=name, role=role, created_at=utcnow())
                s.add(user)
            return user
        except IntegrityError:
            return None

    def get_user(self, name: str) -> UserRow | None:
        with self.session() as s:
            return s.get(UserRow, name)

    def users(self) -> list[UserRow]:
        with self.session() as s:
            return list(s.scalars(select(UserRow).order_by(UserRow.name)))

    def create_token(self, user: str, label: str) -> tuple[TokenRow, str]:
        """A new token for ``user`` and its secret, which is not kept."""
        secret = "et_" + secrets.token_urlsafe(32)
        row = TokenRow(
            id=f"tok-{secrets.token_hex(8)}",
            user=user,
            label=label,
            secret_hash=hash_secret(secret),
            created_at=utcnow(),
        )
        with self.session() as s:
            s.add(row)
        return row, secret

    def tokens(self, user: str | None = None) -> list[TokenRow]:
        query = select(TokenRow).order_by(TokenRow.created_at, TokenRow.id)
        if user is not None:
            query = query.where(TokenRow.user == user)
        with self.session() as s:
            return list(s.scalars(query))

    def revoke_token(self, token_id: str) -> TokenRow | None:
        with self.session() as s:
            row = s.get(TokenRow, token_id)
            if row is not None and row.revoked_at is None:
                row.revoked_at = utcnow()
            return row

    def token_active(self, token_id: str) -> bool:
        """Whether the token still works: not revoked, and its user still exists."""
        query = (
            select(TokenRow.id)
            .join(UserRow, TokenRow.user == UserRow.name)
            .where(TokenRow.id == token_id, TokenRow.revoked_at.is_(None))
        )
        with self.session() as s:
            return s.execute(query).first() is not None

    # -- limits per user ------------------------------------------------------------------

    def user_limits(self, user: str) -> dict[str, Any]:
        """The limits an admin set for ``user`` (only those set)."""
        with self.session() as s:
            row = s.get(UserLimitRow, user)
            return _limits_of(row)

    def all_user_limits(self) -> dict[str, dict[str, Any]]:
        with self.session() as s:
            return {row.user: _limits_of(row) for row in s.scalars(select(UserLimitRow))}

    def set_user_limits(self, user: str, limits: dict[str, Any]) -> dict[str, Any]:
        """Replace the limits set for ``user``: a limit left out (or None) is the default."""
        with self.session() as s:
            row = s.get(UserLimitRow, user)
            if row is None:
                row = UserLimitRow(user=user)
                s.add(row)
            for name in LIMIT_COLUMNS:
                setattr(row, name, limits.get(name))
            row.updated_at = utcnow()
            return _limits_of(row)

    def authenticate(self, secret: str) -> tuple[UserRow, TokenRow] | None:
        """The user and token a secret belongs to, unless it is unknown or revoked."""
        query = (
            select(UserRow, TokenRow)
            .join(TokenRow, TokenRow.user == UserRow.name)
            .where(TokenRow.secret_hash == hash_secret(secret), TokenRow.revoked_at.is_(None))
        )
        with self.session() as s:
            row = s.execute(query).first()
        return (row[0], row[1]) if row else None

    # -- idempotency keys -----------------------------------------------------------------

    def claim_idempotency_key(
        self, owner: str, key: str, fingerprint: str, stale_after_s: float
    ) -> IdempotencyRow | None:
        """Reserve ``key`` for a submission: None when this caller got it, else the record
        that holds it. A reservation left without a job for ``stale_after_s`` (the service
        died mid-submission) is taken over."""
        now = utcnow()
        try:
            with self.session() as s:
                s.add(
                    IdempotencyRow(
                        owner=owner, key=key, fingerprint=fingerprint, job_id=None, created_at=now
                    )
                )
            return None
        except IntegrityError:
            pass
        with self.session() as s:
            row = s.get(IdempotencyRow, (owner, key), with_for_update=True)
            if row is None:  # released in between: try once more
                s.add(
                    IdempotencyRow(
                        owner=owner, key=key, fingerprint=fingerprint, job_id=None, created_at=now
                    )
                )
                return None
            created = (
                row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=UTC)
            )
            if row.job_id is None and (now - created).total_seconds() > stale_after_s:
                row.fingerprint, row.created_at = fingerprint, now
                return None
            return row

    def release_idempotency_key(self, owner: str, key: str) -> None:
        """Free the key of a submission that was refused before it made a job."""
        with self.session() as s:
            s.execute(
                delete(IdempotencyRow).where(
                    IdempotencyRow.owner == owner,
                    IdempotencyRow.key == key,
                    IdempotencyRow.job_id.is_(None),
                )
            )

    # -- events -------------------------------------------------------------------------

    def events(
        self, job_id: str, after: int = 0, limit: int = 1000, kinds: Sequence[str] | None = None
    ) -> list[EventRow]:
        query = (
            select(EventRow)
            .where(EventRow.job_id == job_id, EventRow.seq > after)
            .order_by(EventRow.seq)
            .limit(limit)
        )
        if kinds:
            query = query.where(EventRow.kind.in_(kinds))
        with self.session() as s:
            return list(s.scalars(query))

    def metrics(
        self,
        job_id: str,
        every: int | None = None,
        points: int | None = None,
        max_points: int = MAX_METRIC_POINTS,
    ) -> tuple[int, dict[str, list[Any]]]:
        """(points stored, the job's metrics as columns in step order), downsampled in the
        database: every ``every``-th point, or about ``points`` evenly spread, and never
        more than about ``max_points``; the last point is always kept."""
        with self.session() as s:
            total = int(s.scalar(select(func.count()).where(MetricRow.job_id == job_id)) or 0)
            if total == 0:
                return 0, {name: [] for name in METRIC_COLUMNS}
            stride = metric_stride(total, every, points, max_points)
            numbered = select(
                *(getattr(MetricRow, c) for c in METRIC_COLUMNS),
                func.row_number().over(order_by=MetricRow.seq).label("n"),
            ).where(MetricRow.job_id == job_id)
            if stride == 1:
                rows = s.execute(numbered.order_by(MetricRow.seq)).all()
            else:
                sub = numbered.subquery()
                query = (
                    select(*(sub.c[c] for c in METRIC_COLUMNS))
                    .where(or_((sub.c.n - 1) % stride == 0, sub.c.n == total))
                    .order_by(sub.c.n)
                )
                rows = s.execute(query).all()
        return total, {name: [r[i] for r in rows] for i, name in enumerate(METRIC_COLUMNS)}

    def purge_finished(self, finished_before: datetime) -> int:
        """Delete the metrics and log lines of jobs that ended before ``finished_before``
        (their record, state changes and checkpoints stay). Returns the rows deleted."""
        ended = select(JobRow.id).where(
            JobRow.finished_at.is_not(None), JobRow.finished_at < finished_before
        )
        gone = 0
        with self.session() as s:
            for statement in (
                delete(MetricRow).where(MetricRow.job_id.in_(ended)),
                delete(EventRow).where(EventRow.job_id.in_(ended), EventRow.kind.in_(PURGED_KINDS)),
            ):
                result: Any = s.execute(statement)
                gone += int(result.rowcount or 0)
        return gone

    def append_events(self, job_id: str, events: Sequence[dict[str, Any]]) -> JobRow:
        """Store events (``{seq, kind, time, data}``) and fold them into the job's summary,
        in one transaction. Events at or below the stored sequence are already here."""
        with self.session() as s:
            job = s.get(JobRow, job_id, with_for_update=True)
            if job is None:
                raise KeyError(job_id)
            for ev in sorted(events, key=lambda e: e["seq"]):
                if ev["seq"] <= job.last_seq:
                    continue
                if ev["seq"] != job.last_seq + 1:
                    raise ValueError(
                        f"event {ev['seq']} of {job_id} leaves a gap after {job.last_seq}"
                    )
                s.add(
                    EventRow(
                        job_id=job_id,
                        seq=ev["seq"],
                        kind=ev["kind"],
                        time=ev["time"],
                        data=ev["data"],
                    )
                )
                _fold(s, job, ev)
                job.last_seq = ev["seq"]
            job.updated_at = utcnow()
            return job

    # -- checkpoints --------------------------------------------------------------------

    def checkpoints(self, job_id: str) -> list[CheckpointRow]:
        query = (
            select(CheckpointRow)
            .where(CheckpointRow.job_id == job_id, CheckpointRow.removed.is_(False))
            .order_by(CheckpointRow.step)
        )
        with self.session() as s:
            return list(s.scalars(query))


def metric_stride(
    total: int, every: int | None, points: int | None, max_points: int = MAX_METRIC_POINTS
) -> int:
    """Every how many stored points one is returned (see ``Store.metrics``)."""
    stride = every or (max(1, -(-total // points)) if points else 1)
    return max(stride, -(-total // max_points))


def _limits_of(row: UserLimitRow | None) -> dict[str, Any]:
    if row is None:
        return {}
    return {name: getattr(row, name) for name in LIMIT_COLUMNS if getattr(row, name) is not None}


def job_relative(path: str, job_id: str) -> str:
    """A checkpoint's path as the API shows it: relative to the job's checkpoint
    directory, which says nothing of where the service keeps its files."""
    marker = f"/{job_id}/"
    at = path.rfind(marker)
    if at >= 0:
        return path[at + len(marker) :]
    return os.path.basename(path.rstrip("/"))


PATH_EVENTS = ("checkpoint_saved", "checkpoint_removed", "checkpoint_corrupt")


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


def _fold(s: Session, job: JobRow, ev: dict[str, Any]) -> None:
    """What one event changes in the job's summary row and the checkpoint table."""
    data, kind = ev["data"], ev["kind"]
    when = datetime.fromtimestamp(ev["time"], UTC)
    if kind == "state":
        target = check_transition(JobState(job.state), JobState(data["state"]))
        job.state = target.value
        if data.get("reason") or target.is_terminal:
            job.message = data.get("reason")
        if data.get("world_size"):
            job.world_size = int(data["world_size"])
        if target == JobState.RUNNING and job.started_at is None:
            job.started_at = when
        if target == JobState.RECOVERING:
            job.restarts += 1
        if target.is_terminal:
            job.finished_at = when
            job.world_size = 0
    elif kind == "attempt_started":
        job.world_size = int(data["world_size"])
    elif kind == "metrics":
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
    elif kind == "checkpoint_saved":
        row = s.get(CheckpointRow, (job.id, int(data["step"])))
        if row is None:
            row = CheckpointRow(job_id=job.id, step=int(data["step"]))
            s.add(row)
        row.path, row.size_bytes = data["path"], int(data["size_bytes"])
        row.created_at, row.removed = float(data["created_at"]), False
    elif kind == "checkpoint_removed":
        row = s.get(CheckpointRow, (job.id, int(data["step"])))
        if row is not None:
            row.removed = True


# As many connections kept open as requests run at once (FastAPI's 40 threads for plain
# routes, the event loop's executor for the rest): SQLAlchemy's default of 5 made 50
# concurrent clients queue for a connection, and each overflow connection was opened (with
# its PRAGMAs) and closed again per request (a profile under bench/api_load.py showed both).
POOL: dict[str, Any] = {"pool_size": 40, "max_overflow": 24, "pool_timeout": 30}


def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **POOL
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            # WAL: readers never wait for the event writer; foreign keys: SQLite needs asking.
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, **POOL)
