"""Users and their API tokens: only an admin manages them."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, status

from service.auth import require_admin
from service.problems import PROBLEM_RESPONSES, Problem
from service.schemas import TokenCreated, TokenIn, TokenList, TokenOut, UserIn, UserList, UserOut
from service.store import Store

router = APIRouter(
    prefix="/v1",
    dependencies=[Depends(require_admin)],
    tags=["access"],
    responses=PROBLEM_RESPONSES,
)


def _store(request: Request) -> Store:
    return request.app.state.store


@router.post(
    "/users",
    status_code=status.HTTP_201_CREATED,
    response_model=UserOut,
    summary="Create a user (admin)",
)
async def create_user(body: UserIn, request: Request) -> UserOut:
    user = await asyncio.to_thread(_store(request).create_user, body.name, body.role)
    if user is None:
        raise Problem(409, "User exists", f"there is already a user {body.name!r}")
    return UserOut.model_validate(user)


@router.get("/users", response_model=UserList, summary="All users (admin)")
async def list_users(request: Request) -> UserList:
    users = await asyncio.to_thread(_store(request).users)
    return UserList(items=[UserOut.model_validate(u) for u in users])


@router.post(
    "/tokens",
    status_code=status.HTTP_201_CREATED,
    response_model=TokenCreated,
    summary="Create an API token for a user (admin); the secret is shown once",
)
async def create_token(body: TokenIn, request: Request) -> TokenCreated:
    store = _store(request)
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
    request: Request,
    user: Annotated[str | None, Query(max_length=64)] = None,
) -> TokenList:
    rows = await asyncio.to_thread(_store(request).tokens, user)
    return TokenList(items=[TokenOut.model_validate(r) for r in rows])


@router.post(
    "/tokens/{token_id}/revoke",
    response_model=TokenOut,
    summary="Revoke a token (admin): it stops working at once",
)
async def revoke_token(token_id: str, request: Request) -> TokenOut:
    row = await asyncio.to_thread(_store(request).revoke_token, token_id)
    if row is None:
        raise Problem(404, "Not found", f"no token {token_id!r}")
    return TokenOut.model_validate(row)
