"""The REST API under /v1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response, status
from fastapi.responses import StreamingResponse

from jobs.spec import JobSpec
from jobs.state import JobState
from service import streams
from service.auth import require_token
from service.control import JobControl
from service.problems import Problem
from service.schemas import (
    CheckpointList,
    EventPage,
    JobOut,
    JobPage,
    LogLine,
    LogPage,
    MetricSeries,
    downsample,
)
from service.store import Store

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)])

Caller = Annotated[str, Depends(require_token)]


def _control(request: Request) -> JobControl:
    return request.app.state.control


def _store(request: Request) -> Store:
    return request.app.state.store


Control = Annotated[JobControl, Depends(_control)]
StoreDep = Annotated[Store, Depends(_store)]


def _job(store: Store, job_id: str):
    job = store.get_job(job_id)
    if job is None:
        raise Problem(404, "Not found", f"no job {job_id!r}")
    return job


@router.post("/jobs", status_code=status.HTTP_201_CREATED, response_model=JobOut,
             summary="Submit a training job")
async def submit_job(spec: JobSpec, response: Response, control: Control,
                     caller: Caller) -> JobOut:
    job = await control.submit(spec, owner=caller)
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return JobOut.model_validate(job)


@router.get("/jobs", response_model=JobPage, summary="List jobs, newest first")
def list_jobs(
    store: StoreDep,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=200)] = None,
) -> JobPage:
    try:
        page = store.list_jobs(state, limit, cursor)
    except ValueError as e:
        raise Problem(400, "Invalid request", f"cursor: {e}") from e
    return JobPage(items=[JobOut.model_validate(j) for j in page.items],
                   next_cursor=page.next_cursor)


@router.get("/jobs/{job_id}", response_model=JobOut, summary="One job")
def get_job(job_id: str, store: StoreDep) -> JobOut:
    return JobOut.model_validate(_job(store, job_id))


@router.post("/jobs/{job_id}/cancel", response_model=JobOut, summary="Cancel a job")
async def cancel_job(job_id: str, control: Control) -> JobOut:
    return JobOut.model_validate(await control.cancel(job_id))


@router.get("/jobs/{job_id}/checkpoints", response_model=CheckpointList,
            summary="The job's retained checkpoints, oldest first")
def list_checkpoints(job_id: str, store: StoreDep) -> CheckpointList:
    _job(store, job_id)
    return CheckpointList.model_validate({"items": store.checkpoints(job_id)})


def _wants_sse(request: Request) -> bool:
    return "text/event-stream" in request.headers.get("accept", "")


def _resume_point(request: Request, after: int) -> int:
    last_id = request.headers.get("last-event-id")
    if last_id is None:
        return after
    try:
        return max(after, int(last_id))
    except ValueError as e:
        raise Problem(400, "Invalid request", "Last-Event-ID: not an event number") from e


def _sse(body: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _job_stream(request: Request, store: Store, job_id: str, after: int,
                kinds: tuple[str, ...] | None) -> StreamingResponse:
    return _sse(streams.job_events(store, request.app.state.hub, job_id,
                                   _resume_point(request, after),
                                   request.app.state.settings.sse_keepalive_s, kinds))


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
    store: StoreDep,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
    kind: Annotated[list[str] | None, Query(max_length=20)] = None,
) -> Any:
    await asyncio.to_thread(_job, store, job_id)
    kinds = tuple(kind) if kind else None
    if _wants_sse(request):
        return _job_stream(request, store, job_id, after, kinds)
    events = await asyncio.to_thread(store.events, job_id, after, limit, kinds)
    return EventPage.model_validate(
        {"items": events, "next_after": events[-1].seq if events else after})


@router.get("/jobs/{job_id}/metrics", response_model=MetricSeries,
            summary="The job's metrics as columns, optionally downsampled")
def get_metrics(
    job_id: str,
    store: StoreDep,
    every: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
    points: Annotated[int | None, Query(ge=2, le=100_000)] = None,
) -> MetricSeries:
    _job(store, job_id)
    if every is not None and points is not None:
        raise Problem(400, "Invalid request", "every, points: give one of them, not both")
    columns = store.metrics(job_id)
    total = len(columns["step"])
    keep = downsample(total, every=every, points=points)
    return MetricSeries(total_points=total,
                        columns={k: [v[i] for i in keep] for k, v in columns.items()})


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
    store: StoreDep,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
    follow: bool = False,
) -> Any:
    await asyncio.to_thread(_job, store, job_id)
    if follow:
        return _job_stream(request, store, job_id, after, ("log",))
    events = await asyncio.to_thread(store.events, job_id, after, limit, ("log",))
    lines = [LogLine(seq=e.seq, rank=e.data["rank"], attempt=e.data["attempt"], time=t,
                     stream=stream, line=text)
             for e in events for t, stream, text in e.data["lines"]]
    return LogPage(items=lines, next_after=events[-1].seq if events else after)


@router.get(
    "/events",
    summary="Live job-level changes across all jobs (Server-Sent Events)",
    description="Each message is `event: job` with `data: {type, job}`, `type` one of "
    "created, state, resized. After a reconnect, reload the job list.",
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def all_events(request: Request) -> StreamingResponse:
    settings = request.app.state.settings
    return _sse(streams.all_jobs(request.app.state.hub, settings.sse_keepalive_s,
                                 lambda job: True))
