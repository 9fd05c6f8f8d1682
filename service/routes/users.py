"""Users and their API tokens: only an admin manages them."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, status

from service.deps import ControlDep, Services, ServicesDep, require_admin
from service.problems import PROBLEM_RESPONSES, Problem
from service.quotas import UserLimits
from service.schemas import (
    Limits,
    LimitsIn,
    TokenCreated,
    TokenIn,
    TokenList,
    TokenOut,
    UserIn,
    UserLimitsOut,
    UserList,
    UserOut,
)

log = logging.getLogger(__name__)

router = APIRouter(
    prefix="/v1",
    dependencies=[Depends(require_admin)],
    tags=["access"],
    responses=PROBLEM_RESPONSES,
)


@router.post(
    "/users",
    status_code=status.HTTP_201_CREATED,
    response_model=UserOut,
    summary="Create a user (admin)",
)
async def create_user(body: UserIn, services: ServicesDep) -> UserOut:
    user = await asyncio.to_thread(services.store.create_user, body.name, body.role)
    if user is None:
        raise Problem(409, "User exists", f"there is already a user {body.name!r}")
    return UserOut.model_validate(user)


@router.get("/users", response_model=UserList, summary="All users (admin)")
async def list_users(services: ServicesDep) -> UserList:
    users = await asyncio.to_thread(services.store.users)
    return UserList(items=[UserOut.model_validate(u) for u in users])


@router.post(
    "/tokens",
    status_code=status.HTTP_201_CREATED,
    response_model=TokenCreated,
    summary="Create an API token for a user (admin); the secret is shown once",
)
async def create_token(body: TokenIn, services: ServicesDep) -> TokenCreated:
    store = services.store
    if await asyncio.to_thread(store.get_user, body.user) is None:
        raise Problem(
            422,
            "Invalid request",
            f"user: no user {body.user!r}",
            errors=[{"field": "user", "message": f"no user {body.user!r}"}],
        )
    row, secret = await asyncio.to_thread(store.create_token, body.user, body.label)
    return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=secret)


@router.get("/tokens", response_model=TokenList, summary="API tokens, without secrets (admin)")
async def list_tokens(
    services: ServicesDep,
    user: Annotated[str | None, Query(max_length=64)] = None,
) -> TokenList:
    rows = await asyncio.to_thread(services.store.tokens, user)
    return TokenList(items=[TokenOut.model_validate(r) for r in rows])


@router.post(
    "/tokens/{token_id}/revoke",
    response_model=TokenOut,
    summary="Revoke a token (admin): it stops working at once",
)
async def revoke_token(token_id: str, services: ServicesDep) -> TokenOut:
    row = await asyncio.to_thread(services.store.revoke_token, token_id)
    if row is None:
        raise Problem(404, "Not found", f"no token {token_id!r}")
    services.hub.revoke(token_id)  # its live streams end now, not at their next check
    return TokenOut.model_validate(row)


def _limits_of(services: Services, name: str, overrides: dict[str, Any]) -> UserLimitsOut:
    effective = UserLimits.of(services.settings, overrides)
    return UserLimitsOut(user=name, limits=Limits(**effective.as_dict()), set=LimitsIn(**overrides))


async def _existing_user(services: Services, name: str) -> None:
    if await asyncio.to_thread(services.store.get_user, name) is None:
        raise Problem(404, "Not found", f"no user {name!r}")


@router.get(
    "/users/{name}/limits",
    response_model=UserLimitsOut,
    summary="A user's limits (admin): those set for them, and what applies",
)
async def get_limits(
    name: Annotated[str, Path(max_length=64)], services: ServicesDep
) -> UserLimitsOut:
    await _existing_user(services, name)
    overrides = await asyncio.to_thread(services.store.user_limits, name)
    return _limits_of(services, name, overrides)


@router.put(
    "/users/{name}/limits",
    response_model=UserLimitsOut,
    summary="Set a user's limits (admin); one left out or null is the service's default",
    description="max_workers and max_gpus are the user's scheduling quotas: a job over them "
    "is accepted and waits in the queue (or runs on idle capacity the scheduler lends it); "
    "only a job whose min_workers alone is over them is refused (422). The others are "
    "checked when the user submits a job: over max_active_jobs, or over the max_cpus that "
    "the user's active jobs hold together, is 429; a job that alone needs more than max_cpus "
    "is 422. A job running longer than max_wall_time_s is cancelled. The scheduler gets the "
    "new quotas at once.",
)
async def set_limits(
    name: Annotated[str, Path(max_length=64)],
    body: LimitsIn,
    services: ServicesDep,
    control: ControlDep,
) -> UserLimitsOut:
    await _existing_user(services, name)
    overrides = await asyncio.to_thread(
        services.store.set_user_limits, name, body.model_dump(exclude_none=True)
    )
    try:
        await control.push_quotas()
    except Exception as e:
        # The store holds the limits (admission reads them there now); the control pushes
        # them again within QUOTAS_REPUSH_S.
        log.warning("pushing %s's quotas to the scheduler failed: %s", name, e)
    return _limits_of(services, name, overrides)
