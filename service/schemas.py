"""What the API returns."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from elastic.events import EventKind
from elastic.job_state import JobState
from jobs.spec import priority_value


def _utc(moment: datetime) -> datetime:
    # SQLite hands back naive datetimes; every time the store writes is UTC, and the API's
    # schema promises RFC 3339 date-times, which carry their offset.
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


Timestamp = Annotated[datetime, AfterValidator(_utc)]


def _from_unix(moment: object) -> object:
    # Checkpoints record their time as Unix seconds (the workers write it); the API answers
    # every time in one format, RFC 3339 with its offset.
    return datetime.fromtimestamp(moment, UTC) if isinstance(moment, int | float) else moment


UnixTimestamp = Annotated[datetime, BeforeValidator(_from_unix), AfterValidator(_utc)]


def iso_time(unix: float) -> str:
    """Unix seconds (as workers and supervisors record them) the way the API writes every
    time: ISO 8601 in UTC, as pydantic writes the jobs' datetimes (``...Z``)."""
    return datetime.fromtimestamp(unix, UTC).isoformat().replace("+00:00", "Z")


def event_json(event: dict[str, Any]) -> dict[str, Any]:
    """An event (``{seq, kind, time, data}``, times in Unix seconds) as the API shows it,
    in pages and streams alike: its time, and a log event's line times, in ISO 8601."""
    out = {**event, "time": iso_time(event["time"])}
    lines = event["data"].get("lines") if event["kind"] == EventKind.LOG else None
    if isinstance(lines, list):
        out["data"] = {
            **event["data"],
            "lines": [[iso_time(t), *rest] for t, *rest in lines],
        }
    return out


class JobSummary(BaseModel):
    """A job as the jobs list shows it: everything but its spec, and the spec's worker
    bounds (the table's "world size / min..max")."""

    model_config = ConfigDict(from_attributes=True)

    id: str
    name: str
    owner: str
    workload: str
    state: JobState
    message: str | None
    world_size: int
    min_workers: int
    max_workers: int
    # The spec's priority as a number (a class name as its number; none, in a job stored
    # before priorities: normal's).
    priority: Annotated[int, BeforeValidator(priority_value)]
    step: int
    total_steps: int | None
    last_loss: float | None
    samples_per_s: float | None
    restarts: int
    created_at: Timestamp
    updated_at: Timestamp
    started_at: Timestamp | None
    finished_at: Timestamp | None


class JobOut(JobSummary):
    """One job in full: its summary and the spec it was submitted with."""

    spec: dict[str, Any]


class JobPage(BaseModel):
    items: list[JobSummary]
    next_cursor: str | None


class EventOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    seq: int
    kind: str
    time: UnixTimestamp
    data: dict[str, Any]


class EventPage(BaseModel):
    items: list[EventOut]
    next_after: int


class CheckpointOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    step: int
    path: str
    size_bytes: int
    created_at: UnixTimestamp


class CheckpointList(BaseModel):
    items: list[CheckpointOut]


class MetricSeries(BaseModel):
    total_points: int
    # step, time, loss, accuracy, samples_per_s, learning_rate, world_size: equal lengths;
    # time in ISO 8601 UTC, as every time the API answers.
    columns: dict[str, list[float | int | str | None]]


class LogLine(BaseModel):
    seq: int
    rank: int
    attempt: int
    time: UnixTimestamp
    stream: str
    line: str


class LogPage(BaseModel):
    items: list[LogLine]
    next_after: int


def downsample(total: int, every: int | None = None, points: int | None = None) -> list[int]:
    """Indices to keep: every ``every``-th, or about ``points`` evenly spread; the last
    point is always kept so a chart ends where the run is."""
    if total == 0:
        return []
    stride = every or (max(1, -(-total // points)) if points else 1)
    keep = list(range(0, total, stride))
    if keep[-1] != total - 1:
        keep.append(total - 1)
    return keep


USER_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"


class UserIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        pattern=USER_NAME_PATTERN,
        description="Lower-case letters, digits, '.', '_', '-'; at most 64 characters.",
    )
    role: Literal["admin", "user"] = "user"


class UserOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    role: str
    created_at: Timestamp


class UserList(BaseModel):
    items: list[UserOut]


class TokenIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user: str = Field(pattern=USER_NAME_PATTERN, description="Whose token it is.")
    label: str = Field(
        "",
        max_length=128,
        pattern=r"^[\w .\-]*$",
        description="What the token is for, e.g. 'laptop'.",
    )


class TokenOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: str
    user: str
    label: str
    created_at: Timestamp
    revoked_at: Timestamp | None


class TokenCreated(TokenOut):
    token: str = Field(description="The secret: shown this once, stored only as a hash.")


class TokenList(BaseModel):
    items: list[TokenOut]


class Limits(BaseModel):
    """A user's limits: their active jobs together, and each job's running time."""

    max_active_jobs: int = Field(description="Jobs queued or running at once.")
    max_workers: int | None = Field(
        description="Quota: workers held at once; a job past it waits (or borrows idle "
        "capacity). null: no limit."
    )
    max_cpus: float | None = Field(description="CPUs (at max_workers); null: no limit.")
    max_gpus: int | None = Field(
        description="Quota: GPUs held at once, as max_workers; null: no limit."
    )
    max_wall_time_s: float | None = Field(
        description="Seconds one job may run before it is cancelled; null: no limit."
    )
    code_submission: bool = Field(
        True, description="Whether the user may upload code packages (POST /v1/code)."
    )


class LimitsIn(BaseModel):
    """Limits an admin sets for a user; one left out (or null) is the service's default."""

    model_config = ConfigDict(extra="forbid")

    max_active_jobs: int | None = Field(None, ge=0, le=100_000)
    max_workers: int | None = Field(None, ge=0, le=1_000_000)
    max_cpus: float | None = Field(None, ge=0, le=1e9, allow_inf_nan=False)
    max_gpus: int | None = Field(None, ge=0, le=1_000_000)
    max_wall_time_s: float | None = Field(None, gt=0, le=1e9, allow_inf_nan=False)
    code_submission: bool | None = None


class UserLimitsOut(BaseModel):
    user: str
    limits: Limits = Field(description="What applies: the ones set, else the defaults.")
    set: LimitsIn = Field(description="The ones an admin set for this user.")


class CodePackageOut(BaseModel):
    """A stored code package; a job names it by ``id`` (its spec's ``code``)."""

    id: str = Field(description="The SHA-256 (hex) of the archive's bytes.")
    size_bytes: int = Field(description="The archive's size, as uploaded.")
    files: int = Field(description="Regular files and links in it.")
    unpacked_bytes: int = Field(description="What its files add up to unpacked.")


class Me(BaseModel):
    user: str
    role: str
    limits: Limits


class ClusterWorker(BaseModel):
    job_id: str
    job_name: str
    rank: int


class ClusterNode(BaseModel):
    node_id: str
    address: str
    alive: bool
    is_head: bool
    # CPU and GPU: what the node has, and what is free now
    total: dict[str, float]
    available: dict[str, float]
    workers: list[ClusterWorker]


class ClusterJob(BaseModel):
    id: str
    name: str
    state: JobState
    world_size: int
    # rank -> node id of the job's current attempt, as its workers registered
    workers: dict[int, str]


class ClusterOut(BaseModel):
    nodes: list[ClusterNode]
    jobs: list[ClusterJob]


class QueueEntry(BaseModel):
    """A waiting job: where it stands and why it waits. Another user's entry shows its place
    and priority only (``visible`` false, the rest null), as ``/v1/cluster`` names no other
    user's jobs."""

    position: int = Field(description="1: the next job to start.")
    priority: int
    visible: bool = Field(
        description="Whether the caller may see the job: their own (every job, for an admin)."
    )
    job_id: str | None
    name: str | None
    owner: str | None
    state: JobState | None = Field(description="The job's state in the store.")
    reason: str | None = Field(description="Why it waits, as the scheduler says.")
    expected_start_s: float | None = Field(
        description="Seconds from now until it is expected to start, when knowable."
    )


class RunningEntry(BaseModel):
    """A job that holds workers, and how many of them are borrowed (beyond its owner's
    quota: taken back first). Another user's shows its sizes and priority only."""

    priority: int
    visible: bool
    job_id: str | None
    name: str | None
    owner: str | None
    state: JobState | None
    size: int = Field(description="Workers it holds now.")
    borrowed: int = Field(description="Of those, the workers beyond its owner's quota.")
    min_workers: int
    max_workers: int


class Quota(BaseModel):
    workers: int | None = Field(description="Workers held at once within quota; null: no limit.")
    gpus: float | None = Field(description="GPUs held at once within quota; null: no limit.")


class QueueOut(BaseModel):
    queue: list[QueueEntry] = Field(
        description="A page of the waiting jobs, in the order they start."
    )
    waiting: int = Field(description="How many jobs wait, on every page.")
    next_after_position: int | None = Field(
        description="The `after_position` of the next page; null on the last page."
    )
    running: list[RunningEntry]
    quotas: dict[str, Quota] = Field(
        description="Owner -> quota; '*' is what an owner not named gets. An admin sees "
        "every owner's; a user sees their own and '*'."
    )
