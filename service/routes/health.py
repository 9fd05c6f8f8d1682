"""Liveness, readiness and the API's own description (the Swagger UI, served offline)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from jobs import launcher
from service.deps import ServicesDep
from service.problems import Problem


def install(app: FastAPI) -> None:
    """On the app itself, not an included router: a walk of the app's routes (the access
    test's) finds these open paths as it finds the dashboard's."""
    app.add_api_route("/docs", docs, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        "/healthz",
        healthz,
        methods=["GET"],
        tags=["health"],
        summary="Liveness: the process answers",
    )
    app.add_api_route(
        "/readyz",
        readyz,
        methods=["GET"],
        tags=["health"],
        summary="Readiness: the store and Ray answer",
    )


def docs() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="elastic-train API",
        swagger_js_url="/docs-assets/swagger-ui-bundle.js",
        swagger_css_url="/docs-assets/swagger-ui.css",
        swagger_favicon_url="/docs-assets/favicon-32x32.png",
    )


def healthz() -> dict[str, str]:
    return {"status": "ok"}


def readyz(services: ServicesDep) -> JSONResponse:
    try:
        services.store.ping()
    except Exception as e:
        raise Problem(503, "Not ready", f"the store does not answer: {e}") from e
    if not launcher.is_connected() or services.control is None:
        raise Problem(503, "Not ready", "not connected to Ray yet")
    return JSONResponse({"status": "ready"})
