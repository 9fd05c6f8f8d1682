"""A job's checkpoint as a download: ``GET /v1/jobs/{id}/checkpoints/{step}/download``
streams it as a tar of its manifest and parts (``service.checkpoint_archive``), from the
job's checkpoint directory or bucket, after every part was checked against the manifest."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse

from elastic.checkpoint.storage import join_location, storage_for
from service.checkpoint_archive import (
    Archive,
    CheckpointDamaged,
    CheckpointUnavailable,
    prepare,
)
from service.deps import CallerDep, SettingsDep, StoreDep, require_token
from service.problems import PROBLEM_RESPONSES, Problem, documented_problem
from service.routes.jobs import visible_job
from service.settings import Settings
from service.store import Store

router = APIRouter(prefix="/v1", dependencies=[Depends(require_token)], responses=PROBLEM_RESPONSES)

MEDIA_TYPE = "application/x-tar"


def _archive(store: Store, settings: Settings, job_id: str, step: int) -> Archive:
    rows = [c for c in store.checkpoints(job_id) if c.step == step]
    gone = Problem(404, "Not found", f"no checkpoint at step {step} of job {job_id!r}", step=step)
    # The API shows a checkpoint's path relative to its job's directory: a name there, and
    # nothing else is read (never a path that leaves it).
    if not rows or "/" in rows[0].path or rows[0].path.startswith("."):
        raise gone
    name = rows[0].path
    storage = storage_for(join_location(settings.resolved_checkpoint_dir, job_id))
    try:
        return prepare(storage, name)
    except CheckpointUnavailable:
        raise gone from None
    except CheckpointDamaged as e:
        raise Problem(
            409,
            "Checkpoint corrupt",
            f"checkpoint at step {step}: {e}; it is not sent",
            step=step,
            part=e.part,
        ) from None


@router.get(
    "/jobs/{job_id}/checkpoints/{step}/download",
    summary="One checkpoint as a tar: its manifest.json and parts, under the checkpoint's name",
    description="Every part is checked against the manifest's SHA-256 and size first: a "
    "part that is missing or differs is a 409 naming it (`part`). A part that changes while "
    "the archive is sent ends the stream short of its Content-Length. A step the job has no "
    "checkpoint at (never saved, or removed by retention) is a 404.",
    responses={
        200: {"content": {MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}}},
        409: documented_problem("A part is missing or fails its checksum; `part` names it"),
    },
    response_class=StreamingResponse,
)
async def download_checkpoint(
    job_id: str,
    step: Annotated[int, PathParam(ge=0, le=2**63 - 1)],
    store: StoreDep,
    settings: SettingsDep,
    caller: CallerDep,
) -> StreamingResponse:
    await asyncio.to_thread(visible_job, store, job_id, caller)
    # Hashing every part reads the whole checkpoint: off the event loop.
    archive = await asyncio.to_thread(_archive, store, settings, job_id, step)
    filename = f"{job_id}-step-{step}.tar"
    return StreamingResponse(
        archive.chunks(),  # a plain iterator: Starlette reads it in its thread pool
        media_type=MEDIA_TYPE,
        headers={
            "Content-Length": str(archive.size()),
            "Content-Disposition": f'attachment; filename="{filename}"',
        },
    )
