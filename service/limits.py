"""A cap on request bodies, enforced before anything reads them: 413 past the limit."""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.problems import MEDIA_TYPE


class BodyTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body parsing passes it on rather than calling
    the body malformed; the app's handler then answers it as a problem."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the body may be at most {limit} bytes")


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
        body: dict[str, Any] = {
            "type": "about:blank",
            "title": "Request body too large",
            "status": 413,
            "detail": f"the body may be at most {self.limit} bytes",
            "instance": scope.get("path", ""),
        }
        data = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", MEDIA_TYPE.encode()),
                    (b"content-length", str(len(data)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})
