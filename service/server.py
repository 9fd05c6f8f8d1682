"""The HTTP server's own limits, before any request reaches the app.

uvicorn's default parser (httptools, when installed) takes headers of any size, and a
client that never ends its headers holds its buffer forever. The service runs uvicorn's
h11 parser instead, which refuses a request head over ``max_header_bytes`` (400, and the
connection is closed), and a protocol that also closes a connection whose request head is
not complete within ``header_timeout_s`` and refuses connections past
``max_connections``. uvicorn's ``limit_concurrency`` answers 503 past the same number of
requests in flight.

A kept-alive connection between requests is held as long as a new one that says nothing
(``header_timeout_s``), not uvicorn's default of 5 s: that is httpx's own keep-alive expiry
(5 s), so a client sending its next request on a connection idle for just under 5 s could
meet the server closing it ("Server disconnected without sending a response", as
bench/api_load.py's clients did). A server must keep idle connections longer than its
clients do. The request-head timer ends with each head (see ``handle_events``).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, ClassVar

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.settings import Settings


class GuardedH11Protocol(H11Protocol):
    max_connections: ClassVar[int] = 1000
    header_timeout_s: ClassVar[float] = 30.0

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            transport.close()  # connection_lost takes it out of the count
            return
        # A connection that says nothing is held to the same time as a slow request head.
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_overdue)

    def data_received(self, data: bytes) -> None:
        # Bytes of a request head (none in progress): it must be complete in time.
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_overdue)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        # A request head is complete once its cycle runs: its timer is done. (It closed the
        # connection header_timeout_s after its first byte whenever it found it between two
        # requests, however busy: a client's next request met a closing connection.)
        head_done = self.cycle is not None and not self.cycle.response_complete
        if self._head_timer is not None and head_done:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()  # still no complete request head

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def server_config(app: Any, settings: Settings, **overrides: Any) -> uvicorn.Config:
    """How ``etrain serve`` runs ``app``: its address, and the limits above."""
    protocol = type(
        "ServiceH11Protocol",
        (GuardedH11Protocol,),
        {
            "max_connections": settings.max_connections,
            "header_timeout_s": settings.header_timeout_s,
        },
    )
    values: dict[str, Any] = {
        "host": settings.host,
        "port": settings.port,
        "log_level": settings.log_level.lower(),
        "timeout_graceful_shutdown": 5,
        "http": protocol,
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "limit_concurrency": settings.max_connections,
        "timeout_keep_alive": settings.header_timeout_s,
        **overrides,
    }
    return uvicorn.Config(app, **values)


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, bound to every address of ``host`` as uvicorn's own binding
    does (asyncio's ``create_server``: SO_REUSEADDR, IPv6 sockets IPv6 only). Bound by
    ``etrain serve`` before it starts Ray, which takes many seconds, so that a port in use
    is said at once; listening starts with the server. Raises OSError (none are left open)."""
    infos = socket.getaddrinfo(
        host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind ``host:port`` now (as Ray checks its dashboard's)."""
    try:
        for sock in listening_sockets(host, port):
            sock.close()
    except OSError:
        return False
    return True
