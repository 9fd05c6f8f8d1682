"""What the sync and async clients share: paths, spec checking, the typed reading of
answers, and how a job's event stream is resumed. No I/O here."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from elastic.events import EventKind
from elastic_train.errors import ConnectionFailed
from elastic_train.models import Event

if TYPE_CHECKING:
    import httpx
    from httpx_sse import ServerSentEvent

    from jobs.spec import JobSpec

# Longest silence on a live stream before the client reconnects: the service sends a
# keep-alive comment every ETRAIN_SSE_KEEPALIVE_S (15 s by default).
STREAM_READ_TIMEOUT_S = 60.0
# Server answers on a stream that mean "try again shortly" (a proxy while the API restarts).
# A checkpoint download waits while the service hashes every part before the first byte
# (a few seconds a gigabyte): its reads may take that long, not the client's usual timeout.
DOWNLOAD_READ_TIMEOUT_S = 600.0
RETRYABLE_STATUS = frozenset({502, 503, 504})
PAGE_SIZE = 1000
JOBS_PAGE_SIZE = 100


def job_path(job_id: str, *rest: str) -> str:
    from urllib.parse import quote

    return "/".join(["/v1/jobs", quote(job_id, safe=""), *rest])


def spec_body(spec: JobSpec | Mapping[str, Any]) -> dict[str, Any]:
    """The request body for a spec, checked with the same ``JobSpec`` the service uses, so
    that an invalid spec raises ``pydantic.ValidationError`` before any request is made.
    A mapping is sent as written (the service fills in the defaults itself)."""
    from jobs.spec import JobSpec

    if isinstance(spec, JobSpec):
        return spec.model_dump(mode="json")
    body = dict(spec)
    JobSpec.model_validate(body)
    return body


def stream_kinds(kinds: Iterable[str] | None) -> tuple[str, ...] | None:
    """The kinds to ask the service for: ``state`` always comes along, because the
    job's terminal state is how the client knows that the stream is complete."""
    if kinds is None:
        return None
    asked = tuple(dict.fromkeys(kinds))
    return asked if EventKind.STATE in asked else (*asked, EventKind.STATE)


RECONNECT = object()


class StreamCursor:
    """Where a resumable job stream stands: the last event id received (sent back as
    ``Last-Event-ID`` on reconnect, so nothing is lost or repeated) and whether the
    job's terminal event has arrived."""

    def __init__(self, after: int = 0, kinds: Iterable[str] | None = None) -> None:
        self.last_id = after
        self.wanted = None if kinds is None else frozenset(kinds)
        self.server_kinds = stream_kinds(kinds)
        self.finished = False
        self.connections = 0

    def params(self) -> dict[str, Any]:
        return {"kind": list(self.server_kinds)} if self.server_kinds else {}

    def headers(self) -> dict[str, str]:
        return {"Last-Event-ID": str(self.last_id)} if self.last_id else {}

    def take(self, sse: ServerSentEvent) -> Event | object | None:
        """An event to hand on, :data:`RECONNECT` when the service asks for a reconnect,
        or None for what the caller does not want (or has had already)."""
        if sse.event == "reconnect":
            return RECONNECT
        # A keep-alive comment ends in a blank line, which httpx-sse reports as a message
        # with no data (and the last id, which SSE keeps): not an event.
        if not sse.id or not sse.data:
            return None
        event = Event.model_validate(sse.json())
        if event.seq <= self.last_id:
            return None
        self.last_id = event.seq
        if event.is_terminal:
            self.finished = True
        if self.wanted is not None and event.kind not in self.wanted:
            return None
        return event


class Retrier:
    """Reconnects until the service has not answered for ``give_up_after`` seconds, waiting
    a little longer after each failure (0.25 s doubling to 5 s)."""

    def __init__(
        self, url: str, give_up_after: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.url = url
        self.give_up_after = give_up_after
        self.clock = clock
        self.failing_since: float | None = None
        self.failures = 0

    def connected(self) -> None:
        self.failing_since = None
        self.failures = 0

    def failed(self, reason: str) -> float:
        """Seconds to wait before the next try; ConnectionFailed once it is time to stop."""
        now = self.clock()
        if self.failing_since is None:
            self.failing_since = now
        elif now - self.failing_since >= self.give_up_after:
            raise ConnectionFailed(self.url, reason)
        self.failures += 1
        return min(5.0, 0.25 * 2.0 ** (self.failures - 1))


def transport_reason(error: httpx.TransportError) -> str:
    import httpx

    text = str(error) or type(error).__name__
    if isinstance(error, httpx.TimeoutException):
        return f"no answer in time ({text})"
    if isinstance(error, httpx.ConnectError):
        return text.removeprefix("[Errno 111] ").lower() if "111" in text else text
    return text


def check_deadline(deadline: float | None) -> float | None:
    """Seconds left before ``deadline`` (monotonic), None without one; TimeoutError after."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the job did not end in time")
    return left


def stream_timeout(deadline: float | None, connect: float) -> httpx.Timeout:
    import httpx

    left = check_deadline(deadline)
    read = STREAM_READ_TIMEOUT_S if left is None else min(STREAM_READ_TIMEOUT_S, left)
    return httpx.Timeout(connect, read=read)


def download_timeout(timeout: float) -> httpx.Timeout:
    import httpx

    return httpx.Timeout(timeout, read=max(timeout, DOWNLOAD_READ_TIMEOUT_S))


def download_path(job_id: str, step: int) -> str:
    return job_path(job_id, "checkpoints", str(step), "download")
