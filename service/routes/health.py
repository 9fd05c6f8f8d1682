"""Liveness, readiness and the API's own description (the Swagger UI, served offline)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from jobs import launcher
from service.deps import ServicesDep
from service.problems import Problem

router = APIRouter()


@router.get("/docs", include_in_schema=False)
def docs() -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="elastic-train API",
        swagger_js_url="/docs-assets/swagger-ui-bundle.js",
        swagger_css_url="/docs-assets/swagger-ui.css",
        swagger_favicon_url="/docs-assets/favicon-32x32.png",
    )


@router.get("/healthz", tags=["health"], summary="Liveness: the process answers")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", tags=["health"], summary="Readiness: the store and Ray answer")
def readyz(services: ServicesDep) -> JSONResponse:
    try:
        services.store.ping()
    except Exception as e:
        raise Problem(503, "Not ready", f"the store does not answer: {e}") from e
    if not launcher.is_connected() or services.control is None:
        raise Problem(503, "Not ready", "not connected to Ray yet")
    return JSONResponse({"status": "ready"})
