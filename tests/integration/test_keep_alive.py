"""How long the server keeps a connection: an idle kept-alive one longer than its clients do,
one in use as long as it is used.

uvicorn's default (5 s) equals httpx's keep-alive expiry (5 s): a client that sent its next
request on a connection idle for just under 5 s met the server closing it, and got
"Server disconnected without sending a response" (every error of bench/api_load.py's
runs). The server here is a real uvicorn on a loopback port, configured by
``service.server.server_config`` as `etrain serve` is; the app behind it is a stub (no Ray),
since what is tested is the server's handling of the connection.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from service.server import server_config
from service.settings import Settings
from tests.conftest import free_port

REQUEST = b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@contextmanager
def serving(tmp_path: Path, **settings: object) -> Iterator[int]:
    app = FastAPI()
    app.add_api_route("/ping", lambda: {"pong": True}, methods=["GET"])
    port = free_port()
    config = Settings(data_dir=tmp_path, host="127.0.0.1", port=port, **settings)  # type: ignore[arg-type]
    server = uvicorn.Server(server_config(app, config, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def answer(sock: socket.socket) -> bytes:
    """One whole response to REQUEST (its body is the 13 bytes of {"pong":true})."""
    data = b""
    while not data.endswith(b'{"pong":true}'):
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    return data


def test_an_idle_connection_outlives_the_clients_keep_alive(tmp_path: Path) -> None:
    """Idle for longer than httpx keeps a connection (and uvicorn's default), then reused."""
    idle_s = httpx.Limits().keepalive_expiry
    assert idle_s == 5.0
    with serving(tmp_path) as port, socket.create_connection(("127.0.0.1", port), 10) as sock:
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(idle_s + 1.0)
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200 ")


@pytest.mark.alone  # it bounds when the server closes
def test_an_idle_connection_is_closed_after_the_header_timeout(tmp_path: Path) -> None:
    with (
        serving(tmp_path, header_timeout_s=1.0) as port,
        socket.create_connection(("127.0.0.1", port), 10) as sock,
    ):
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        sock.settimeout(5)
        assert sock.recv(65536) == b""  # closed by the server
        assert 0.9 < time.monotonic() - started < 3.0


def test_a_busy_connection_outlives_the_header_timeout(tmp_path: Path) -> None:
    """A connection in use is never cut: the request-head timer ends with each head (it used
    to close a connection header_timeout_s after it opened, whenever it found it between
    two requests: bench.api_load's clients met that every 30 s)."""
    with (
        serving(tmp_path, header_timeout_s=1.0) as port,
        socket.create_connection(("127.0.0.1", port), 10) as sock,
    ):
        for _ in range(12):  # 3 s: three times the header timeout
            sock.sendall(REQUEST)
            assert answer(sock).startswith(b"HTTP/1.1 200 ")
            time.sleep(0.25)


@pytest.mark.alone  # it bounds when the server closes
def test_a_request_head_that_never_ends_is_cut_off_after_earlier_requests(
    tmp_path: Path,
) -> None:
    """The timer is armed again for the next request's head."""
    with (
        serving(tmp_path, header_timeout_s=1.0) as port,
        socket.create_connection(("127.0.0.1", port), 10) as sock,
    ):
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200 ")
        started = time.monotonic()
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
        sock.settimeout(5)
        assert sock.recv(65536) == b""
        assert 0.9 < time.monotonic() - started < 3.0
