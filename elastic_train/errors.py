"""The errors the client raises on purpose, each readable as one line.

The API answers every error as RFC 9457 problem+json; a rejected spec names each bad field
(``errors: [{"field": ..., "message": ...}]``). :func:`from_problem` turns such an answer
into the typed error for its status, whose ``str()`` names the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class ElasticTrainError(Exception):
    """Base of every error the client raises on purpose (never a bug)."""


class ConfigError(ElasticTrainError):
    """The saved configuration (``etrain login``) cannot be used."""


class ConnectionFailed(ElasticTrainError):
    """The service could not be reached, or stopped answering."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"could not reach {url}: {reason}")
        self.url = url
        self.reason = reason


class CodeArchiveError(ElasticTrainError):
    """A code directory that cannot be packed (e.g. a link that leaves it)."""


class CodeTooLarge(ElasticTrainError):
    """A packed code directory over the service's size limit: the message names the
    biggest files, the likeliest to leave out (``.etrainignore``)."""

    def __init__(self, reason: str, biggest: list[tuple[str, int]]) -> None:
        self.reason = reason
        self.biggest = biggest
        listed = ", ".join(f"{path} ({_size(n)})" for path, n in biggest)
        hint = f"; the biggest files: {listed}" if listed else ""
        super().__init__(f"{reason}{hint} (leave files out with .etrainignore)")


class NoCheckpoint(ElasticTrainError):
    """The job has no checkpoint to download (none saved yet)."""


class CheckpointCorrupt(ElasticTrainError):
    """A downloaded checkpoint does not match its manifest (``part`` names what differs):
    nothing of it was kept."""

    def __init__(self, part: str, reason: str) -> None:
        self.part = part
        self.reason = reason
        super().__init__(f"the downloaded checkpoint is corrupt: {part} {reason}; nothing was kept")


def _size(n: int) -> str:
    from elastic_train.render import size

    return size(n)


@dataclass(frozen=True)
class FieldError:
    field: str
    message: str


class ApiError(ElasticTrainError):
    """The API refused a request; ``status``, ``title``, ``detail`` and ``errors`` are the
    problem document's."""

    status: int = 0

    def __init__(
        self,
        status: int,
        title: str,
        detail: str | None = None,
        errors: list[FieldError] | None = None,
        retry_after: float | None = None,
    ) -> None:
        self.status = status
        self.title = title
        self.detail = detail
        self.errors = errors or []
        self.retry_after = retry_after
        super().__init__(self.line())

    def line(self) -> str:
        """One readable line: each bad field with its message, else the problem's detail."""
        if self.errors:
            what = "; ".join(f"{e.field}: {e.message}" for e in self.errors)
        else:
            what = self.detail or self.title
        return f"{what} ({self.status} {self.title})"


class BadRequest(ApiError):
    """400: a malformed request."""


class Unauthorized(ApiError):
    """401: no valid token."""


class Forbidden(ApiError):
    """403: the token's role may not do this."""


class NotFound(ApiError):
    """404: no such job (or not the caller's)."""


class Conflict(ApiError):
    """409: the job's state rules the request out (e.g. cancelling a finished job)."""


class PayloadTooLarge(ApiError):
    """413: the request body is too large."""


class InvalidRequest(ApiError):
    """422: the service refused the spec or a parameter; ``errors`` names each field."""


class RateLimited(ApiError):
    """429: the token's rate limit is reached; ``retry_after`` says for how long."""


class ServerError(ApiError):
    """5xx: the service failed (the error is in its log)."""


_BY_STATUS: dict[int, type[ApiError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    422: InvalidRequest,
    429: RateLimited,
}


def from_problem(status: int, body: bytes, headers: dict[str, str] | None = None) -> ApiError:
    """The typed error for an error answer, from its problem document when it has one
    (a proxy in front of the service may answer with plain text or HTML instead)."""
    problem: dict[str, Any] = {}
    try:
        parsed = json.loads(body) if body else {}
        if isinstance(parsed, dict):
            problem = parsed
    except ValueError:
        pass
    title = str(problem.get("title") or _default_title(status))
    detail = problem.get("detail")
    if detail is None and not problem and body:
        detail = body.decode(errors="replace").strip().splitlines()[0][:200] or None
    errors = [
        FieldError(str(e.get("field", "")), str(e.get("message", "")))
        for e in problem.get("errors") or []
        if isinstance(e, dict)
    ]
    retry_after = _seconds((headers or {}).get("retry-after"))
    kind = _BY_STATUS.get(status, ServerError if status >= 500 else ApiError)
    return kind(status, title, None if detail is None else str(detail), errors, retry_after)


def _default_title(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "HTTP error"


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
