"""The REST API under /v1."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response, status

from jobs.spec import JobSpec
from jobs.state import JobState
from service.auth import require_token
from service.control import JobControl
from service.problems import Problem
from service.schemas import CheckpointList, EventPage, JobOut, JobPage
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


@router.get("/jobs/{job_id}/events", response_model=EventPage,
            summary="The job's event log, in order")
def list_events(
    job_id: str,
    store: StoreDep,
    after: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 1000,
) -> EventPage:
    _job(store, job_id)
    events = store.events(job_id, after, limit)
    return EventPage.model_validate(
        {"items": events, "next_after": events[-1].seq if events else after})
