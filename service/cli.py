"""The ``etrain`` command."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from service.auth import TOKEN_FILE, resolve_admin_token
from service.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="etrain", description="elastic-train")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the API service")
    serve.add_argument("--host", help="bind address (default: ETRAIN_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: ETRAIN_PORT or 8000)")
    args = parser.parse_args(argv)

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = Settings(**overrides)
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token, generated = resolve_admin_token(settings)
    url = f"http://{settings.host}:{settings.port}"
    print(f"elastic-train on {url}  (API docs: {url}/docs)", flush=True)
    if settings.api_token is not None:
        # A configured token stays out of the logs (on Kubernetes they are widely readable).
        print("admin token: the one in ETRAIN_API_TOKEN", flush=True)
    else:
        where = settings.data_dir / TOKEN_FILE
        how = "generated, stored in" if generated else "from"
        print(f"admin token ({how} {where}): {token}", flush=True)

    from service.app import create_app

    # Live streams never end on their own: give them a few seconds, then close them, so
    # that Ctrl-C or SIGTERM does not wait on a dashboard left open.
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
