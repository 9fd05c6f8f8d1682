"""Guards on requests, enforced before anything reads them: a cap on bodies (413 past it),
and no NUL byte in a path (404: no file or route has one; static file lookups would
otherwise fail on it with an error)."""

from __future__ import annotations

import json

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.problems import MEDIA_TYPE


class BodyTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body parsing passes it on rather than calling
    the body malformed; the app's handler then answers it as a problem."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the body may be at most {limit} bytes")


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
    send: Send, status: int, title: str, detail: str, instance: str, close: bool = False
) -> None:
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail}
    body["instance"] = instance.replace("\x00", "%00")
    data = json.dumps(body).encode()
    headers = [
        (b"content-type", MEDIA_TYPE.encode()),
        (b"content-length", str(len(data)).encode()),
    ]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class BodySizeLimit:
    """Refuses a declared Content-Length over ``limit`` at once, and cuts off a body that
    streams in (chunked) past it."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(scope, send)
                return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
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
                await self._refuse(scope, send)

    async def _refuse(self, scope: Scope, send: Send) -> None:
        await _send_problem(
            send,
            413,
            "Request body too large",
            f"the body may be at most {self.limit} bytes",
            scope.get("path", ""),
            close=True,
        )
