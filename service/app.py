"""The FastAPI application: wiring of settings, store, Ray and the routes."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

from jobs import launcher
from service import dashboard, deps, metrics, problems
from service.auth import BOOTSTRAP_ADMIN, RateLimiter, resolve_admin_token
from service.control import JobControl
from service.limits import BodySizeLimit, NulInPath, PathLimit
from service.routes import checkpoints, cluster, code, files, health, jobs, users
from service.settings import Settings
from service.store import Store
from service.streams import Hub

log = logging.getLogger(__name__)

DEFAULT_EXECUTOR_THREADS = 24


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    services = _services(settings)
    app = FastAPI(
        title="elastic-train",
        version="0.1.0",
        description="Elastic PyTorch training on Ray.",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
    )
    deps.attach(app, services)
    problems.install(app)
    code_body = PathLimit("POST", code.CODE_PATH, settings.max_code_bytes, "max_code_bytes")
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes, larger=(code_body,))
    app.add_middleware(NulInPath)
    app.add_middleware(metrics.HttpMetrics, metrics=services.metrics)  # outermost: sees all
    for router in (
        jobs.router,
        checkpoints.router,
        files.router,
        code.router,
        users.router,
        cluster.router,
        metrics.router,
    ):
        app.include_router(router)
    health.install(app)
    # Swagger UI from the PyPI package's files: /docs works with no internet.
    app.mount("/docs-assets", StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")
    # Last: its / and /ui routes must not shadow the ones above.
    dashboard.install(app, settings.dashboard_dir)
    return app


def _services(settings: Settings) -> deps.Services:
    store = Store(settings.resolved_database_url)
    store.ensure_user(BOOTSTRAP_ADMIN, "admin")
    hub = Hub(settings.sse_client_buffer, settings.max_streams_per_token)
    service_metrics = metrics.ServiceMetrics(store)
    hub.observe(service_metrics.observe_events)
    admin_token, _ = resolve_admin_token(settings)
    return deps.Services(
        settings=settings,
        store=store,
        hub=hub,
        admin_token=admin_token,
        rate_limiter=RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst),
        metrics=service_metrics,
    )


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    services = deps.services_of(app)
    settings = services.settings
    # asyncio.to_thread's default pool has min(32, CPUs + 4) threads: 6 on two cores,
    # shared by every async route's store calls and the event pump, so 50 clients
    # submitting at once queued behind each other.
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=DEFAULT_EXECUTOR_THREADS, thread_name_prefix="etrain")
    )
    token = settings.ray_auth_token
    connected = await asyncio.to_thread(
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
    await asyncio.to_thread(_warm_up, services)
    mlflow_uri = settings.mlflow_tracking_uri
    launcher.configure_mlflow(
        launcher.MlflowTarget(mlflow_uri.get_secret_value(), settings.mlflow_experiment)
        if mlflow_uri
        else None
    )
    _reclaim_sigterm()
    services.control = JobControl(settings, services.store, services.hub)
    await _push_quotas(services.control)
    services.control.start()
    _build_middleware_stack(app)
    # What start-up made (Ray, FastAPI, SQLAlchemy and their imports: 140 000 objects) lives
    # as long as the service: out of the collector's sight, a full collection no longer
    # scans it, and requests stop pausing 70-150 ms for one every few seconds.
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        # A process that builds another app after this one (the tests) collects this one's.
        gc.unfreeze()
        await services.control.stop()
        services.store.close()
        if connected:
            await asyncio.to_thread(launcher.disconnect)


def _warm_up(services: deps.Services) -> None:
    """What the first requests would otherwise pay while clients wait, done before the
    server listens (uvicorn binds its port only after the lifespan's start): the supervisor's
    actor class sent to Ray (the first launch held the GIL for 0.1-0.25 s with it)."""
    try:
        if not launcher.export_supervisor_class():
            log.warning("warm-up: this Ray's internals differ; the first launch exports")
    except Exception:
        log.warning("warm-up: exporting the supervisor's class failed", exc_info=True)


async def _push_quotas(control: JobControl) -> None:
    """The scheduler knows every user's quota before the first job is submitted; if it cannot
    be reached now, the service starts anyway and the control's re-push tries again."""
    try:
        await control.push_quotas()
    except Exception:
        log.error("start-up: pushing the quotas to the scheduler failed", exc_info=True)


def _build_middleware_stack(app: FastAPI) -> None:
    """Starlette builds an app's middleware stack at its first request: built before the
    server listens instead, so that no client pays it."""
    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()


def _reclaim_sigterm() -> None:
    """Ray's core worker installs a native SIGTERM handler in the driver (it logs a stack
    trace and exits); put back the Python one (uvicorn's, for a graceful shutdown)."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler):
        signal.signal(signal.SIGTERM, handler)
