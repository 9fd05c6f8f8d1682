"""The FastAPI application: wiring of settings, store, Ray and the routes."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

from jobs import launcher
from service import api, cluster_api, dashboard, metrics, problems, users_api
from service.auth import BOOTSTRAP_ADMIN, RateLimiter, resolve_admin_token
from service.control import JobControl
from service.limits import BodySizeLimit, NulInPath
from service.problems import Problem
from service.settings import Settings
from service.store import Store
from service.streams import Hub

log = logging.getLogger(__name__)

DEFAULT_EXECUTOR_THREADS = 24


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # asyncio.to_thread's default pool has min(32, CPUs + 4) threads: 6 on two cores,
        # shared by every async route's store calls and the event pump, so 50 clients
        # submitting at once queued behind each other.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(max_workers=DEFAULT_EXECUTOR_THREADS, thread_name_prefix="etrain")
        )
        token = settings.ray_auth_token
        await asyncio.to_thread(
            launcher.connect,
            settings.ray_address,
            settings.ray_namespace,
            settings.ray_num_cpus,
            settings.ray_num_gpus,
            token.get_secret_value() if token else None,
            settings.ray_auth_token_path,
            settings.worker_env,
            settings.ray_dashboard_port,
        )
        _reclaim_sigterm()
        control = JobControl(settings, app.state.store, app.state.hub)
        app.state.control = control
        control.start()
        try:
            yield
        finally:
            await control.stop()
            app.state.store.close()

    app = FastAPI(
        title="elastic-train",
        version="0.1.0",
        description="Elastic PyTorch training on Ray.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.store = Store(settings.resolved_database_url)
    app.state.store.ensure_user(BOOTSTRAP_ADMIN, "admin")
    app.state.hub = Hub(settings.sse_client_buffer, settings.max_streams_per_token)
    app.state.admin_token, _ = resolve_admin_token(settings)
    app.state.rate_limiter = RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst)
    app.state.metrics = metrics.ServiceMetrics(app.state.store)
    app.state.hub.observe(app.state.metrics.observe_events)
    problems.install(app)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    app.add_middleware(NulInPath)
    app.add_middleware(metrics.HttpMetrics, metrics=app.state.metrics)  # outermost: sees all
    app.include_router(api.router)
    app.include_router(users_api.router)
    app.include_router(cluster_api.router)
    app.include_router(metrics.router)
    # Swagger UI from the PyPI package's files: /docs works with no internet.
    app.mount("/docs-assets", StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="elastic-train API",
            swagger_js_url="/docs-assets/swagger-ui-bundle.js",
            swagger_css_url="/docs-assets/swagger-ui.css",
            swagger_favicon_url="/docs-assets/favicon-32x32.png",
        )

    @app.get("/healthz", tags=["health"], summary="Liveness: the process answers")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], summary="Readiness: the store and Ray answer")
    def readyz(request: Request) -> JSONResponse:
        try:
            request.app.state.store.ping()
        except Exception as e:
            raise Problem(503, "Not ready", f"the store does not answer: {e}") from e
        if not launcher.is_connected() or not hasattr(request.app.state, "control"):
            raise Problem(503, "Not ready", "not connected to Ray yet")
        return JSONResponse({"status": "ready"})

    dashboard.install(
        app, settings.dashboard_dir
    )  # last: its / and /ui routes must not shadow the ones above
    return app


def _reclaim_sigterm() -> None:
    """Ray's core worker installs a native SIGTERM handler in the driver (it logs a stack
    trace and exits); put back the Python one (uvicorn's, for a graceful shutdown)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)
