"""What the routes depend on: the service's parts, typed, and the caller behind a request.

The parts live in one `Services` object on the app (``app.state`` is untyped; this is the
one place that reads it), made by `create_app`; the job control joins once Ray answers.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.auth import BOOTSTRAP_ADMIN, BOOTSTRAP_TOKEN_ID, Caller, RateLimiter
from service.problems import Problem
from service.settings import Settings
from service.store import Store
from service.streams import Hub

if TYPE_CHECKING:
    from service.control import JobControl
    from service.metrics import ServiceMetrics


@dataclass
class Services:
    settings: Settings
    store: Store
    hub: Hub
    admin_token: str
    rate_limiter: RateLimiter
    metrics: ServiceMetrics
    # None until the lifespan has connected to Ray.
    control: JobControl | None = None


def attach(app: FastAPI, services: Services) -> None:
    app.state.services = services


def services_of(app: FastAPI) -> Services:
    services: Services = app.state.services
    return services


def get_services(request: Request) -> Services:
    return services_of(request.app)


def get_settings(request: Request) -> Settings:
    return services_of(request.app).settings


def get_store(request: Request) -> Store:
    return services_of(request.app).store


def get_hub(request: Request) -> Hub:
    return services_of(request.app).hub


def get_control(request: Request) -> JobControl:
    control = services_of(request.app).control
    if control is None:
        raise Problem(503, "Not ready", "not connected to Ray yet", headers={"Retry-After": "1"})
    return control


ServicesDep = Annotated[Services, Depends(get_services)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[Store, Depends(get_store)]
HubDep = Annotated[Hub, Depends(get_hub)]
ControlDep = Annotated["JobControl", Depends(get_control)]

_bearer = HTTPBearer(auto_error=False, description="An API token of this service.")
BearerDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def unauthorized(detail: str, error: str | None = None) -> Problem:
    challenge = f'Bearer error="{error}"' if error else "Bearer"
    return Problem(401, "Unauthorized", detail, headers={"WWW-Authenticate": challenge})


def authenticate(services: Services, secret: str) -> Caller | None:
    """The caller a token secret belongs to: the bootstrap admin's, or a stored token's."""
    if secrets.compare_digest(secret.encode(), services.admin_token.encode()):
        return Caller(BOOTSTRAP_ADMIN, "admin", BOOTSTRAP_TOKEN_ID)
    found = services.store.authenticate(secret)
    if found is None:
        return None
    user, token = found
    return Caller(user.name, "admin" if user.role == "admin" else "user", token.id)


def require_token(services: ServicesDep, credentials: BearerDep) -> Caller:
    """The caller, for any valid token of any role; 401 without one, 429 over its rate."""
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise unauthorized("send 'Authorization: Bearer <token>'")
    caller = authenticate(services, credentials.credentials)
    if caller is None:
        raise unauthorized("the token is not valid", "invalid_token")
    wait = services.rate_limiter.wait_needed(caller.token_id)
    if wait > 0:
        retry = max(1, math.ceil(wait))
        raise Problem(
            429,
            "Too many requests",
            f"this token's rate limit is reached; retry in {retry} s",
            headers={"Retry-After": str(retry)},
        )
    return caller


def require_admin(caller: Annotated[Caller, Depends(require_token)]) -> Caller:
    if not caller.is_admin:
        raise Problem(403, "Forbidden", "only an admin may do this")
    return caller


CallerDep = Annotated[Caller, Depends(require_token)]
AdminDep = Annotated[Caller, Depends(require_admin)]
