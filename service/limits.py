"""Guards on requests, enforced before anything reads them: a cap on bodies (413 past it),
and no NUL byte in a path (404: no file or route has one; static file lookups would
otherwise fail on it with an error)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.problems import MEDIA_TYPE


class BodyTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body parsing passes it on rather than calling
    the body malformed; the app's handler then answers it as a problem."""

    def __init__(self, limit: int, setting: str = "max_body_bytes") -> None:
        super().__init__(413, too_large_detail(limit, setting, None))


def too_large_detail(limit: int, setting: str, size: int | None) -> str:
    """What a 413 says: the route's own limit is named by its setting, with the size when
    the request declared it."""
    if setting == "max_body_bytes":
        return f"the body may be at most {limit} bytes"
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return f"{setting}: the body is {what}, over the limit of {limit} bytes"


class NulInPath:
    """A path with a NUL byte in it (``/ui/%00``) names nothing: 404 for every route, the
    static files' included, before they try to open it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "\x00" in scope.get("path", ""):
            await _send_problem(send, 404, "Not found", "no such path", scope.get("path", ""))
            return
        await self.app(scope, receive, send)


async def _send_problem(
    send: Send,
    status: int,
    title: str,
    detail: str,
    instance: str,
    close: bool = False,
    extensions: dict[str, object] | None = None,
) -> None:
    body: dict[str, object] = {
        "type": "about:blank",
        "title": title,
        "status": status,
        "detail": detail,
    }
    body["instance"] = instance.replace("\x00", "%00")
    body.update(extensions or {})
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", MEDIA_TYPE.encode()),
        (b"content-length", str(len(data)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


@dataclass(frozen=True)
class PathLimit:
    """A larger body limit for one route (e.g. code packages), named by its setting."""

    method: str
    path: str
    limit: int
    setting: str


class BodySizeLimit:
    """Refuses a declared Content-Length over the limit at once, and cuts off a body that
    streams in (chunked) past it. The limit is ``limit``, or a route's own in ``larger``:
    either way, no more than it is ever read."""

    def __init__(self, app: ASGIApp, limit: int, larger: tuple[PathLimit, ...] = ()) -> None:
        self.app, self.limit, self.larger = app, limit, larger

    def _limit_of(self, scope: Scope) -> tuple[int, str]:
        for route in self.larger:
            if scope.get("method") == route.method and scope.get("path") == route.path:
                return route.limit, route.setting
        return self.limit, "max_body_bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, setting = self._limit_of(scope)
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await self._refuse(scope, send, limit, setting, int(value))
                return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit, setting)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(scope, send, limit, setting, None)

    async def _refuse(
        self, scope: Scope, send: Send, limit: int, setting: str, size: int | None
    ) -> None:
        detail = too_large_detail(limit, setting, size)
        extensions: dict[str, object] = {}
        if setting != "max_body_bytes":
            extensions = {"limit": setting, "max_bytes": limit}
            if size is not None:
                extensions["size_bytes"] = size
        await _send_problem(
            send,
            413,
            "Request body too large",
            detail,
            scope.get("path", ""),
            close=True,
            extensions=extensions,
        )
