"""The web dashboard: the static app under dashboards/app at /, and the chart library that
npm installed under dashboards/node_modules. No token here: these are static files, and the
data they show comes from the token-protected API."""

from __future__ import annotations

import html
import logging
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

log = logging.getLogger(__name__)

DASHBOARD_DIR = Path(__file__).resolve().parent.parent / "dashboards"
APP_DIR = DASHBOARD_DIR / "app"
# The one file of each npm package that the app loads.
VENDOR = {"uplot": DASHBOARD_DIR / "node_modules" / "uplot" / "dist"}
VENDOR_FILES = ("uplot/uPlot.esm.js", "uplot/uPlot.min.css")

# The app loads only its own files and talks only to this service.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "style-src 'self' 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; "
    "base-uri 'self'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def missing_dependencies() -> list[str]:
    """The library files the app needs that are not installed."""
    return [
        name
        for name in VENDOR_FILES
        if not (VENDOR[name.split("/")[0]] / name.split("/", 1)[1]).is_file()
    ]


def _not_installed_page(missing: list[str]) -> HTMLResponse:
    items = "".join(f"<li><code>{html.escape(m)}</code></li>" for m in missing)
    body = (
        "<!doctype html><html lang=en><meta charset=utf-8>"
        "<title>elastic-train: dashboard not installed</title>"
        "<body style='font-family:system-ui,sans-serif;max-width:40rem;margin:3rem auto'>"
        "<h1>The dashboard's JavaScript dependencies are not installed</h1>"
        f"<p>Missing under <code>{html.escape(str(DASHBOARD_DIR / 'node_modules'))}</code>:</p>"
        f"<ul>{items}</ul>"
        "<p>Install them with <code>npm ci</code> in <code>dashboards/</code> "
        "(<code>make run</code> does it; it needs Node.js and npm). "
        "The API works without them: <a href='/docs'>/docs</a>.</p></body></html>"
    )
    return HTMLResponse(body, status_code=503, headers=HEADERS)


def install(app: FastAPI) -> None:
    missing = missing_dependencies()
    if missing:
        log.warning(
            "the dashboard at / cannot work: %s not installed; run `npm ci` in %s",
            ", ".join(missing),
            DASHBOARD_DIR,
        )

    @app.get("/", include_in_schema=False)
    def index() -> Response:
        still_missing = missing_dependencies()
        if still_missing:
            return _not_installed_page(still_missing)
        return FileResponse(
            APP_DIR / "index.html", headers={**HEADERS, "Cache-Control": "no-cache"}
        )

    # Mounts stay out of the OpenAPI schema. The vendor mount comes first: /ui would
    # otherwise swallow its paths.
    for name, directory in VENDOR.items():
        app.mount(
            f"/ui/vendor/{name}",
            StaticFiles(directory=directory, check_dir=False),
            name=f"dashboard-vendor-{name}",
        )
    app.mount("/ui", StaticFiles(directory=APP_DIR), name="dashboard")
