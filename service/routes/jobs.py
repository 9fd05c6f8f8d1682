"""The jobs API under /v1: submit, list, read, cancel, and each job's events, logs,
metrics and checkpoints; /v1/me and the all-jobs stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response, status
from fastapi.responses import StreamingResponse

from elastic.events import EventKind
from elastic.job_state import JobState
from jobs.spec import JobSpec
from service import streams
from service.auth import BOOTSTRAP_TOKEN_ID, Caller
from service.deps import (
    CallerDep,
    ControlDep,
    Services,
    ServicesDep,
    SettingsDep,
    StoreDep,
    require_token,
)
from service.problems import PROBLEM_RESPONSES, Problem
from service.quotas import UserLimits, check_priority
from service.schemas import (
    CheckpointList,
    EventPage,
    JobOut,
    JobPage,
    JobSummary,
    Limits,
    LogLine,
    LogPage,
    Me,
    MetricSeries,
    event_json,
    iso_time,
)
from service.store import JobRow, Store, event_dict

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=PROBLEM_RESPONSES)


def visible_job(store: Store, job_id: str, caller: Caller) -> JobRow:
    """The job, if the caller may see it: another user's job is as absent as a missing one,
    so that ids cannot be probed."""
    job = store.get_job(job_id)
    if job is None or not caller.may_see(job.owner):
        raise Problem(404, "Not found", f"no job {job_id!r}")
    return job


@router.get("/me", response_model=Me, summary="Who the token belongs to, and their limits")
def me(caller: CallerDep, settings: SettingsDep, store: StoreDep) -> Me:
    limits = UserLimits.of(settings, store.user_limits(caller.user))
    return Me(user=caller.user, role=caller.role, limits=Limits(**limits.as_dict()))


# The largest event number a query or Last-Event-ID may name: a signed 64-bit integer, what
# every store can compare with.
MAX_SEQ = 2**63 - 1


@router.post(
    "/jobs",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    summary="Submit a training job",
    description="With an `Idempotency-Key` header, a retry with the same key and body "
    "answers 200 with the job the first request made; the same key with another body is "
    "422, and a retry while the first request is still being processed is 409. A priority "
    "above normal (50) is an admin's: 403 for anyone else.",
    responses={200: {"model": JobOut, "description": "A replay of an earlier submission"}},
)
async def submit_job(
    spec: JobSpec,
    response: Response,
    control: ControlDep,
    caller: CallerDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=255)] = None,
) -> JobOut:
    check_priority(caller.user, caller.is_admin, spec)
    job, replayed = await control.submit_once(spec, caller.user, idempotency_key)
    if replayed:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut.model_validate(job)


@router.get("/jobs", response_model=JobPage, summary="List jobs, newest first")
def list_jobs(
    store: StoreDep,
    caller: CallerDep,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> JobPage:
    try:
        page = store.list_jobs(state, limit, cursor, owner=None if caller.is_admin else caller.user)
    except ValueError as e:
        raise Problem(400, "Invalid request", f"cursor: {e}") from e
    return JobPage(
        items=[JobSummary.model_validate(j) for j in page.items], next_cursor=page.next_cursor
    )


@router.get("/jobs/{job_id}", response_model=JobOut, summary="One job")
def get_job(job_id: str, store: StoreDep, caller: CallerDep) -> JobOut:
    return JobOut.model_validate(visible_job(store, job_id, caller))


@router.post("/jobs/{job_id}/cancel", response_model=JobOut, summary="Cancel a job")
async def cancel_job(
    job_id: str, store: StoreDep, control: ControlDep, caller: CallerDep
) -> JobOut:
    await asyncio.to_thread(visible_job, store, job_id, caller)
    return JobOut.model_validate(await control.cancel(job_id))


@router.get(
    "/jobs/{job_id}/checkpoints",
    response_model=CheckpointList,
    summary="The job's retained checkpoints, oldest first",
)
def list_checkpoints(job_id: str, store: StoreDep, caller: CallerDep) -> CheckpointList:
    visible_job(store, job_id, caller)
    return CheckpointList.model_validate({"items": store.checkpoints(job_id)})


def _wants_sse(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def _resume_point(request: Request, after: int) -> int:
    last_id = request.headers.get("last-event-id")
    if last_id is None:
        return after
    text = last_id.strip()
    if not text.isdigit() or len(text) > len(str(MAX_SEQ)) or int(text) > MAX_SEQ:
        raise Problem(
            400,
            "Invalid header",
            f"Last-Event-ID: not an event number (0 to {MAX_SEQ})",
            errors=[{"field": "Last-Event-ID", "message": f"an integer from 0 to {MAX_SEQ}"}],
        )
    return max(after, int(text))


class _TokenStream(StreamingResponse):
    """An SSE response that holds one of its token's stream slots until it is done, however
    it ends (the client may leave before the first byte)."""

    def __init__(self, body: AsyncIterator[str], release: Callable[[], None]) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def _stream_slot(hub: streams.Hub, caller: Caller) -> Callable[[], None]:
    """Take one of the caller's token's stream slots (429 when all are in use); returns
    what gives it back."""
    if not hub.claim_stream(caller.token_id):
        cap = hub.streams_per_token
        raise Problem(
            429,
            "Too many streams",
            f"max_streams_per_token: this token has {cap} live streams open, the most "
            "allowed; close one first",
            headers={"Retry-After": "1"},
            limit="max_streams_per_token",
        )
    return lambda: hub.release_stream(caller.token_id)


def _token_check(store: Store, caller: Caller) -> streams.StillAllowed | None:
    if caller.token_id == BOOTSTRAP_TOKEN_ID:
        return None  # the configured admin token lives as long as the process

    async def still_allowed() -> bool:
        return await asyncio.to_thread(store.token_active, caller.token_id)

    return still_allowed


def _job_stream(
    request: Request,
    services: Services,
    caller: Caller,
    job_id: str,
    after: int,
    kinds: tuple[str, ...] | None,
) -> StreamingResponse:
    resume = _resume_point(request, after)
    release = _stream_slot(services.hub, caller)
    return _TokenStream(
        streams.job_events(
            services.store,
            services.hub,
            job_id,
            resume,
            services.settings.sse_keepalive_s,
            kinds,
            caller.token_id,
            _token_check(services.store, caller),
        ),
        release,
    )


@router.get(
    "/jobs/{job_id}/events",
    response_model=EventPage,
    summary="The job's event log: a JSON page, or live Server-Sent Events",
    description="With `Accept: text/event-stream`: every event after `after` (or "
    "`Last-Event-ID`) as SSE (`id` = sequence number, `event` = kind, `data` = JSON), then "
    "live ones, ending after the job's terminal event. Otherwise a JSON page.",
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def list_events(
    job_id: str,
    request: Request,
    services: ServicesDep,
    caller: CallerDep,
    after: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
    kind: Annotated[list[Annotated[str, Query(max_length=32)]] | None, Query(max_length=20)] = None,
) -> Any:
    store = services.store
    await asyncio.to_thread(visible_job, store, job_id, caller)
    kinds = tuple(kind) if kind else None
    if _wants_sse(request):
        return _job_stream(request, services, caller, job_id, after, kinds)
    events = await asyncio.to_thread(store.events, job_id, after, limit, kinds)
    return EventPage.model_validate(
        {
            "items": [event_json(event_dict(e)) for e in events],
            "next_after": events[-1].seq if events else after,
        }
    )


@router.get(
    "/jobs/{job_id}/metrics",
    response_model=MetricSeries,
    summary="The job's metrics as columns, optionally downsampled",
)
def get_metrics(
    job_id: str,
    store: StoreDep,
    caller: CallerDep,
    every: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
    points: Annotated[int | None, Query(ge=2, le=100_000)] = None,
) -> MetricSeries:
    visible_job(store, job_id, caller)
    if every is not None and points is not None:
        raise Problem(400, "Invalid request", "every, points: give one of them, not both")
    total, columns = store.metrics(job_id, every=every, points=points)
    times = columns["time"]
    return MetricSeries(
        total_points=total, columns={**columns, "time": [iso_time(t) for t in times]}
    )


@router.get(
    "/jobs/{job_id}/logs",
    response_model=LogPage,
    summary="Worker log lines (stdout, stderr, logging), tagged with rank and attempt",
    description="`follow=true` streams them as Server-Sent Events until the job ends.",
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def get_logs(
    job_id: str,
    request: Request,
    services: ServicesDep,
    caller: CallerDep,
    after: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
    follow: bool = False,
) -> Any:
    store = services.store
    await asyncio.to_thread(visible_job, store, job_id, caller)
    if follow:
        return _job_stream(request, services, caller, job_id, after, (EventKind.LOG,))
    events = await asyncio.to_thread(store.events, job_id, after, limit, ("log",))
    lines = [
        LogLine(
            seq=e.seq,
            rank=e.data["rank"],
            attempt=e.data["attempt"],
            time=t,
            stream=stream,
            line=text,
        )
        for e in events
        for t, stream, text in e.data["lines"]
    ]
    return LogPage(items=lines, next_after=events[-1].seq if events else after)


@router.get(
    "/events",
    summary="Live job-level changes across the caller's jobs (all jobs for an admin), as "
    "Server-Sent Events",
    description="Each message is `event: job` with `data: {type, job}`, `type` one of "
    "created, state, resized. After a reconnect, reload the job list.",
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def all_events(services: ServicesDep, caller: CallerDep) -> StreamingResponse:
    release = _stream_slot(services.hub, caller)
    return _TokenStream(
        streams.all_jobs(
            services.hub,
            services.settings.sse_keepalive_s,
            lambda job: caller.may_see(job["owner"]),
            caller.token_id,
            _token_check(services.store, caller),
        ),
        release,
    )
