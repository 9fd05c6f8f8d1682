"""Code packages under /v1/code: a user uploads a tar.gz of their training code, and a job
names it by its content id. The check (``jobs.code_package``) runs before anything is
stored; packages are kept per owner (``jobs.code_store``), so one user's id means nothing
to another."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response, status

from jobs.code_package import CodePackage, PackageLimits, PackageRefused, check
from jobs.code_store import CodeStore, is_package_id
from service.deps import CallerDep, ServicesDep, SettingsDep, require_token
from service.limits import too_large_detail
from service.problems import PROBLEM_RESPONSES, Problem, documented_problem
from service.quotas import UserLimits, check_code_allowed
from service.schemas import CodePackageOut
from service.settings import Settings

CODE_PATH = "/v1/code"
ACCEPTED_TYPES = ("application/gzip", "application/x-gzip", "application/octet-stream")

router = APIRouter(
    prefix="/v1",
    dependencies=[Depends(require_token)],
    tags=["code"],
    responses=PROBLEM_RESPONSES,
)


def code_store(settings: Settings) -> CodeStore:
    """The packages' store: beside the checkpoints, where every Ray node reads."""
    return CodeStore(settings.resolved_checkpoint_dir)


def too_large(limit: int, size: int) -> Problem:
    """The 413 of a package over ``max_code_bytes``, as the body middleware words it."""
    return Problem(
        413,
        "Request body too large",
        too_large_detail(limit, "max_code_bytes", size),
        limit="max_code_bytes",
        max_bytes=limit,
        size_bytes=size,
    )


def refused(e: PackageRefused) -> Problem:
    if e.entry is None:
        return Problem(422, "Invalid code package", str(e), rule=e.rule)
    errors = [{"field": e.entry, "message": e.message}]
    return Problem(422, "Invalid code package", str(e), rule=e.rule, errors=errors)


def _out(package: CodePackage) -> CodePackageOut:
    return CodePackageOut(
        id=package.id,
        size_bytes=package.size_bytes,
        files=package.files,
        unpacked_bytes=package.unpacked_bytes,
    )


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


_BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {t: {"schema": {"type": "string", "format": "binary"}} for t in ACCEPTED_TYPES},
    }
}


@router.post(
    "/code",
    status_code=status.HTTP_201_CREATED,
    response_model=CodePackageOut,
    summary="Upload a code package (a tar.gz of training code)",
    description="The body is the archive itself. 201 for a package new to the caller, 200 "
    "(nothing changes) when the caller has it already: the id is the SHA-256 of the bytes. "
    "Over max_code_bytes is 413; an entry that could unpack outside its directory, a "
    "device or FIFO, more than max_code_files entries or more than max_code_unpacked_bytes "
    "unpacked is 422 naming the entry; 403 when code submission is off for the caller.",
    responses={
        200: {"model": CodePackageOut, "description": "The caller had this package already"},
        415: documented_problem("The body is not sent as application/gzip"),
    },
    openapi_extra=_BINARY_BODY,
)
async def upload_code(
    request: Request, response: Response, services: ServicesDep, caller: CallerDep
) -> CodePackageOut:
    settings = services.settings
    media_type = _media_type(request)
    if media_type not in ACCEPTED_TYPES:
        raise Problem(
            415,
            "Unsupported media type",
            f"Content-Type: send the tar.gz as application/gzip, not {media_type or 'nothing'}",
            errors=[{"field": "Content-Type", "message": "expected application/gzip"}],
        )
    overrides = await asyncio.to_thread(services.store.user_limits, caller.user)
    check_code_allowed(caller.user, UserLimits.of(settings, overrides))
    # The body middleware has cut it off at max_code_bytes already; this is its backstop.
    data = await request.body()
    if len(data) > settings.max_code_bytes:
        raise too_large(settings.max_code_bytes, len(data))
    limits = PackageLimits(settings.max_code_files, settings.max_code_unpacked_bytes)
    try:
        package = await asyncio.to_thread(check, data, limits)
    except PackageRefused as e:
        raise refused(e) from None
    store = code_store(settings)
    stored = await asyncio.to_thread(store.put, caller.user, package.id, data, package)
    if not stored:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"{CODE_PATH}/{package.id}"
    return _out(package)


@router.get(
    "/code/{package_id}",
    response_model=CodePackageOut,
    summary="A code package of the caller's",
    description="An admin may read another user's package by naming them in `owner`; for "
    "anyone else another user's package is as absent as an unknown one (404).",
)
async def get_code(
    package_id: str,
    settings: SettingsDep,
    caller: CallerDep,
    owner: Annotated[str | None, Query(max_length=64)] = None,
) -> CodePackageOut:
    whose = owner or caller.user
    missing = Problem(404, "Not found", f"no code package {package_id!r}")
    if not is_package_id(package_id) or not caller.may_see(whose):
        raise missing
    package = await asyncio.to_thread(code_store(settings).info, whose, package_id)
    if package is None:
        raise missing
    return _out(package)
