"""Errors over HTTP as RFC 9457 problem details (application/problem+json)."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobs.validation import describe
from service.errors import (
    IdempotencyKeyReused,
    JobAlreadyEnded,
    JobNotFound,
    SpecRefused,
    SubmissionInProgress,
)

log = logging.getLogger(__name__)

MEDIA_TYPE = "application/problem+json"


class FieldError(BaseModel):
    field: str
    message: str


class ProblemOut(BaseModel):
    """An RFC 9457 problem document, as every error is answered."""

    model_config = ConfigDict(extra="allow")

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[FieldError] | None = None


def _described(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "model": ProblemOut,
        "content": {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/ProblemOut"}}},
    }


def documented_problem(description: str) -> dict[str, Any]:
    """An OpenAPI response of one route's own (``responses={status: ...}``): a problem."""
    return _described(description)


# The errors any authenticated route may answer, documented once for the OpenAPI schema.
PROBLEM_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _described("A malformed request"),
    401: _described("No valid token"),
    403: _described("The token's role may not do this"),
    404: _described("No such resource (or not the caller's)"),
    409: _described("A conflict with the resource's state"),
    413: _described("The request body is too large"),
    422: _described("The body or a parameter is invalid; `errors` names each field"),
    429: _described("The token's rate limit is reached; see Retry-After"),
}


class Problem(Exception):
    def __init__(
        self,
        status: int,
        title: str,
        detail: str | None = None,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail or title)
        self.status, self.title, self.detail = status, title, detail
        self.headers = headers or {}
        self.extensions = extensions


def invalid(
    errors: list[dict[str, str]], status: int = 422, title: str = "Invalid job spec"
) -> Problem:
    """A rejection of the request, each error naming its field."""
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return Problem(status, title if status == 422 else "Invalid request", detail, errors=errors)


# Where FastAPI found the invalid value -> the title of the 422.
_PLACES = {
    "query": "Invalid query parameter",
    "header": "Invalid header",
    "path": "Invalid path parameter",
    "cookie": "Invalid cookie",
}


def validation_title(request: Request, errors: list[Any]) -> str:
    """What was invalid: the job spec, another body, a query parameter, a header..."""
    places = {str(e["loc"][0]) for e in errors if e.get("loc")}
    if places == {"body"}:
        is_spec = request.method == "POST" and request.url.path == "/v1/jobs"
        return "Invalid job spec" if is_spec else "Invalid request body"
    if len(places) == 1:
        return _PLACES.get(places.pop(), "Invalid request")
    return "Invalid request"


def problem_response(request: Request, p: Problem) -> JSONResponse:
    body: dict[str, Any] = {"type": "about:blank", "title": p.title, "status": p.status}
    if p.detail:
        body["detail"] = p.detail
    body["instance"] = request.url.path
    body.update(p.extensions)
    return ProblemResponse(body, status_code=p.status, media_type=MEDIA_TYPE, headers=p.headers)


class ProblemResponse(JSONResponse):
    """JSON in ASCII only: a problem often quotes what the client sent, and a client that
    guesses the charset of ``application/problem+json`` (it names none) then still reads it
    right."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, allow_nan=False, separators=(",", ":")).encode("ascii")


def install(app: FastAPI) -> None:
    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        return problem_response(request, exc)

    @app.exception_handler(JobNotFound)
    async def _not_found(request: Request, exc: JobNotFound) -> JSONResponse:
        return problem_response(request, Problem(404, "Not found", str(exc)))

    @app.exception_handler(SpecRefused)
    async def _refused(request: Request, exc: SpecRefused) -> JSONResponse:
        limit: dict[str, Any] = {} if exc.limit is None else {"limit": exc.limit}
        errors = [{"field": exc.field, "message": exc.message}]
        p = Problem(422, exc.title, f"{exc.field}: {exc.detail}", errors=errors, **limit)
        return problem_response(request, p)

    @app.exception_handler(JobAlreadyEnded)
    async def _ended(request: Request, exc: JobAlreadyEnded) -> JSONResponse:
        p = Problem(409, "Job already ended", str(exc), state=exc.state)
        return problem_response(request, p)

    @app.exception_handler(IdempotencyKeyReused)
    async def _reused(request: Request, exc: IdempotencyKeyReused) -> JSONResponse:
        p = Problem(
            422,
            "Idempotency-Key reused",
            "this Idempotency-Key was used with a different request body",
            errors=[{"field": "Idempotency-Key", "message": "already used with a different body"}],
        )
        return problem_response(request, p)

    @app.exception_handler(SubmissionInProgress)
    async def _in_progress(request: Request, exc: SubmissionInProgress) -> JSONResponse:
        p = Problem(
            409,
            "Request in progress",
            "a request with this Idempotency-Key is still being processed; retry later",
            headers={"Retry-After": "1"},
        )
        return problem_response(request, p)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        return problem_response(
            request, invalid(describe(errors), title=validation_title(request, errors))
        )

    @app.exception_handler(ValidationError)
    async def _pydantic(request: Request, exc: ValidationError) -> JSONResponse:
        return problem_response(request, invalid(describe(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        titles = {
            404: "Not found",
            405: "Method not allowed",
            401: "Unauthorized",
            413: "Request body too large",
        }
        p = Problem(
            exc.status_code,
            titles.get(exc.status_code, "HTTP error"),
            str(exc.detail) if exc.detail else None,
            headers=dict(exc.headers or {}),
        )
        return problem_response(request, p)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return problem_response(
            request, Problem(500, "Internal server error", "the error was logged on the server")
        )
