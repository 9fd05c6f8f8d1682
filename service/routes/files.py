"""A job's own directory as a download: ``GET /v1/jobs/{id}/files`` streams what the job's
code wrote in ``ETRAIN_CHECKPOINT_DIR`` as an uncompressed tar (``service.job_files``)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from jobs.launcher import files_dir
from jobs.spec import JobSpec
from service.deps import CallerDep, SettingsDep, StoreDep, require_token
from service.job_files import JobFiles, find
from service.problems import PROBLEM_RESPONSES, Problem
from service.routes.jobs import visible_job
from service.settings import Settings
from service.store import JobRow

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=PROBLEM_RESPONSES)

MEDIA_TYPE = "application/x-tar"

log = logging.getLogger(__name__)


def _files(settings: Settings, job: JobRow) -> JobFiles:
    if not JobSpec.model_validate(job.spec).runs_user_code:
        raise Problem(
            404,
            "Not found",
            f"job {job.id!r} runs the built-in workload {job.workload!r}, which has no "
            "directory of its own",
        )
    location = files_dir(settings.resolved_checkpoint_dir, job.owner, job.id)
    try:
        found = find(location, job.id)
    except OSError as e:
        # The directory is there but the service may not open it (workers that write as the
        # owner's uid, a service that is not root): a deployment's fault, said as such.
        log.error("job %s: its directory %s is unreadable: %s", job.id, location, e)
        raise Problem(
            500, "Files unreadable", f"the service cannot read job {job.id!r}'s directory"
        ) from None
    if found is None:
        raise Problem(
            404,
            "Not found",
            f"job {job.id!r} has no files: it wrote nothing in its ETRAIN_CHECKPOINT_DIR "
            "(or it has not started yet)",
        )
    return found


@router.get(
    "/jobs/{job_id}/files",
    summary="What the job's code wrote in its own directory, as a tar",
    description="The job's `ETRAIN_CHECKPOINT_DIR` (a command job, or a `train_loop` of a "
    "code package), as an uncompressed tar under a top directory named after the job. A "
    "symbolic link is stored as a link, never followed; FIFOs, sockets and devices are left "
    "out. A running job's files are sent as they are while the archive is read: a file "
    "cut shorter meanwhile ends the stream early. A job that wrote nothing there, or runs a "
    "built-in workload, is a 404.",
    responses={200: {"content": {MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}}},
    response_class=StreamingResponse,
)
async def download_files(
    job_id: str, store: StoreDep, settings: SettingsDep, caller: CallerDep
) -> StreamingResponse:
    job = await asyncio.to_thread(visible_job, store, job_id, caller)
    # A bucket's listing is a network call: off the event loop.
    files = await asyncio.to_thread(_files, settings, job)
    return StreamingResponse(
        files.chunks(),  # a plain iterator: Starlette reads it in its thread pool
        media_type=MEDIA_TYPE,
        headers={"Content-Disposition": f'attachment; filename="{job_id}-files.tar"'},
    )
