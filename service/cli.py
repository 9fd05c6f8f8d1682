"""The ``etrain`` command."""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import signal
import sys
from types import FrameType
from typing import Any

import uvicorn

from service.auth import TOKEN_FILE, resolve_admin_token
from service.server import listening_sockets, port_is_free, server_config
from service.settings import Settings

# Where jobs.launcher has an embedded Ray's dashboard listen: loopback only.
RAY_DASHBOARD_HOST = "127.0.0.1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="etrain", description="elastic-train")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the API service")
    serve.add_argument("--host", help="bind address (default: ETRAIN_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: ETRAIN_PORT or 8000)")
    args = parser.parse_args(argv)

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Before Ray starts (many seconds) and before the banner and a new token are printed.
    busy = busy_dashboard_port(settings)
    if busy:
        return fail(busy)
    try:
        sockets = listening_sockets(settings.host, settings.port)
    except OSError as e:
        return fail(cannot_listen(settings, e))
    token, generated = resolve_admin_token(settings)
    url = f"http://{settings.host}:{settings.port}"
    print(f"elastic-train on {url}  (API docs: {url}/docs)", flush=True)
    print(admin_token_notice(settings, token, generated), flush=True)

    from service.app import create_app
    from service.deps import services_of

    app = create_app(settings)
    # After the graceful shutdown uvicorn re-raises the signal to this handler: a normal
    # exit, so that atexit hooks (an embedded Ray's shutdown) run.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # In-flight requests get up to 5 s to finish; live streams are told to end at once.
    server = GracefulServer(services_of(app).hub, server_config(app, settings))
    server.run(sockets=sockets)
    return 0


def fail(message: str) -> int:
    """A start-up that cannot go on: one line, as etrain's other commands say errors."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


def cannot_listen(settings: Settings, error: OSError) -> str:
    """Why the server cannot have its address, and the settings that choose another."""
    where = f"{settings.host}:{settings.port}"
    if error.errno == errno.EADDRINUSE:
        return f"{where} is already in use; choose another port with --port or ETRAIN_PORT"
    reason = error.strerror or str(error)
    return (
        f"cannot listen on {where} ({reason}); choose another address with --host and "
        "--port, or ETRAIN_HOST and ETRAIN_PORT"
    )


def busy_dashboard_port(settings: Settings) -> str | None:
    """A port set for the embedded Ray's dashboard that is in use: Ray would fail on it
    only after starting its other processes, with a traceback. Unset, Ray takes 8265 or
    the next free port."""
    port = settings.ray_dashboard_port
    if settings.ray_address or port is None or port_is_free(RAY_DASHBOARD_HOST, port):
        return None
    return (
        f"{RAY_DASHBOARD_HOST}:{port}, the embedded Ray's dashboard port, is already in use; "
        "choose another with ETRAIN_RAY_DASHBOARD_PORT, or unset it for a free one"
    )


def admin_token_notice(settings: Settings, token: str, generated: bool) -> str:
    """What start-up says of the admin token. The secret itself is printed once, when it is
    generated: later starts (and a configured token, which would otherwise land in logs
    that on Kubernetes are widely readable) only say where it is."""
    if settings.api_token is not None:
        return "admin token: the one in ETRAIN_API_TOKEN"
    where = settings.data_dir / TOKEN_FILE
    if generated:
        return f"admin token (generated, stored in {where}, shown this once): {token}"
    return f"admin token: in {where}"


class GracefulServer(uvicorn.Server):
    """On SIGTERM/SIGINT: stop accepting, let in-flight requests finish, and close the
    SSE streams cleanly (each gets a last `reconnect` message) instead of cutting them."""

    def __init__(self, hub: Any, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.hub = hub
        self.loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if sockets is not None and self.started:
            # uvicorn says where it listens ("Uvicorn running on ...") only of sockets it
            # bound itself.
            self._log_started_message(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.hub.close)


if __name__ == "__main__":
    sys.exit(main())
