"""The store: jobs, their event log and checkpoints, users, tokens, limits and idempotency
keys, through SQLAlchemy 2 (SQLite or PostgreSQL)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, func, or_, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from elastic.events import EventKind
from elastic.job_state import TERMINAL_STATES, JobState
from service.store.cursor import Page, decode_cursor, encode_cursor
from service.store.database import make_engine, migrate
from service.store.fold import fold
from service.store.models import (
    LIMIT_COLUMNS,
    MAX_METRIC_POINTS,
    METRIC_COLUMNS,
    PURGED_KINDS,
    SUMMARY_COLUMNS,
    CheckpointRow,
    EventRow,
    IdempotencyRow,
    JobRow,
    MetricRow,
    TokenRow,
    UserLimitRow,
    UserRow,
    hash_secret,
    new_job_id,
    utcnow,
)


class Store:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine: Engine = make_engine(url)
        migrate(self.engine)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # Reads of one statement need no transaction: on PostgreSQL each of BEGIN and
        # COMMIT is a round trip of its own, and a profile under bench/api_load.py showed
        # reads spending more time in them than in their SELECT.
        self._reader = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._reads = sessionmaker(self._reader, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    def ping(self) -> None:
        with self.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions.begin() as s:
            yield s

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for one read statement, outside any transaction."""
        with self._reads() as s:
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
                    kind=EventKind.STATE,
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
        with self.read() as s:
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
        with self._reader.connect() as conn:
            rows = list(conn.execute(query))
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(rows, encode_cursor(rows[-1].id) if more and rows else None)

    def active_jobs(self, owner: str | None = None, rows: bool = True) -> list[JobRow]:
        """Jobs not yet ended; only ``owner``'s when given; without the queued jobs that
        never started unless ``rows`` (see :meth:`row_ids`)."""
        # IN the live states, not NOT IN the ended ones: the state index finds the few live
        # jobs among 10 000 ended ones instead of a scan (a profile under load showed it).
        live = [s.value for s in JobState if s not in TERMINAL_STATES]
        query = select(JobRow).where(JobRow.state.in_(live))
        if owner is not None:
            query = query.where(JobRow.owner == owner)
        if not rows:
            query = query.where(
                or_(JobRow.state != JobState.QUEUED.value, JobRow.started_at.is_not(None))
            )
        with self.read() as s:
            return list(s.scalars(query))

    def names_and_states(self, ids: Sequence[str]) -> dict[str, Any]:
        """Job id -> a row of its ``id``, ``name`` and ``state``, for each of ``ids`` that
        exists: the columns ``GET /v1/queue`` shows, without reading a thousand whole rows."""
        out: dict[str, Any] = {}
        with self._reader.connect() as conn:
            for at in range(0, len(ids), 500):
                chunk = list(ids[at : at + 500])
                query = select(JobRow.id, JobRow.name, JobRow.state).where(JobRow.id.in_(chunk))
                out.update((row.id, row) for row in conn.execute(query))
        return out

    def row_ids(self) -> list[str]:
        """The queued jobs that never started, oldest first: rows with no process of their
        own (service/control/queued_rows.py). Only their ids: a thousand whole rows read
        twice a second held the API's requests up (their specs are read once each)."""
        query = (
            select(JobRow.id)
            .where(JobRow.state == JobState.QUEUED.value, JobRow.started_at.is_(None))
            .order_by(JobRow.id)
        )
        with self._reader.connect() as conn:
            return [row.id for row in conn.execute(query)]

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
        with self.read() as s:
            return s.get(UserRow, name)

    def users(self) -> list[UserRow]:
        with self.read() as s:
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
        with self.read() as s:
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
        with self.read() as s:
            return s.execute(query).first() is not None

    # -- limits per user ------------------------------------------------------------------

    def user_limits(self, user: str) -> dict[str, Any]:
        """The limits an admin set for ``user`` (only those set)."""
        with self.read() as s:
            row = s.get(UserLimitRow, user)
            return _limits_of(row)

    def all_user_limits(self) -> dict[str, dict[str, Any]]:
        with self.read() as s:
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
        with self.read() as s:
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
        with self.read() as s:
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
                fold(s, job, ev)
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
        with self.read() as s:
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
