"""The single bearer token that every endpoint but the health checks demands."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.problems import Problem
from service.settings import Settings

TOKEN_FILE = "admin-token"

_bearer = HTTPBearer(auto_error=False, description="The service's API token.")


def resolve_admin_token(settings: Settings) -> tuple[str, bool]:
    """The configured token, else the one stored under data_dir (made on first start).
    Returns (token, whether it was just generated)."""
    if settings.api_token is not None and settings.api_token.get_secret_value():
        return settings.api_token.get_secret_value(), False
    path = Path(settings.data_dir) / TOKEN_FILE
    if path.is_file():
        return path.read_text().strip(), False
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def require_token(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The caller's identity; for now the one admin."""
    expected: str = request.app.state.admin_token
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Problem(401, "Unauthorized", "send 'Authorization: Bearer <token>'",
                      headers={"WWW-Authenticate": "Bearer"})
    if not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise Problem(401, "Unauthorized", "the token is not valid",
                      headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
    return "admin"
