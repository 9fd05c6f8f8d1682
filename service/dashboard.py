"""The web dashboard: the static app under <dashboard dir>/app at /, and the chart library
that npm installed under <dashboard dir>/node_modules. No token here: these are static files,
and the data they show comes from the token-protected API.

The dashboard dir is ``ETRAIN_DASHBOARD_DIR`` when set; otherwise the copy that an installed
wheel carries inside this package (setup.py's build hook lays it out; the container image
installs such a wheel), and without one, ``dashboards/`` beside the source tree (a checkout,
whose editable install carries no copy)."""

from __future__ import annotations

import html
import importlib.resources
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from elastic.job_state import TERMINAL_STATES, JobState
from service.dashboard_assets import PACKAGE_DIR, VENDOR_FILES, vendor_packages

log = logging.getLogger(__name__)

SOURCE_TREE_DIR = Path(__file__).resolve().parent.parent / "dashboards"

# The app loads only its own files and talks only to this service.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "style-src 'self' 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'; "
    "base-uri 'self'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class DashboardFiles:
    root: Path

    @property
    def app(self) -> Path:
        return self.root / "app"

    def vendor(self, package: str) -> Path:
        return self.root / "node_modules" / package / "dist"

    @property
    def packages(self) -> list[str]:
        return vendor_packages()

    def missing(self) -> list[str]:
        """What the app needs and this directory lacks: its index page or a library file."""
        needed = [] if (self.app / "index.html").is_file() else ["app/index.html"]
        for name in VENDOR_FILES:
            package, file = name.split("/", 1)
            if not (self.vendor(package) / file).is_file():
                needed.append(f"node_modules/{package}/dist/{file}")
        return needed


def packaged_dir() -> Path | None:
    """The dashboard inside the installed package: a wheel's, None in an editable install
    (or a zipped one, whose files StaticFiles could not serve)."""
    packaged = importlib.resources.files("service") / PACKAGE_DIR
    return packaged if isinstance(packaged, Path) and packaged.is_dir() else None


def files_for(directory: Path | None) -> DashboardFiles:
    return DashboardFiles((directory or packaged_dir() or SOURCE_TREE_DIR).resolve())


def missing_dependencies(directory: Path | None = None) -> list[str]:
    return files_for(directory).missing()


def states_module() -> str:
    """The job states for the dashboard's scripts, from the state machine itself, so that the
    browser never holds a copy of them that could drift."""
    states = [s.value for s in JobState]
    terminal = [s for s in states if JobState(s) in TERMINAL_STATES]
    return (
        "// The job states, served from elastic/job_state.py.\n"
        f"export const STATES = {json.dumps(states)};\n"
        f"export const TERMINAL = new Set({json.dumps(terminal)});\n"
    )


def _not_installed_page(files: DashboardFiles, missing: list[str]) -> HTMLResponse:
    items = "".join(f"<li><code>{html.escape(m)}</code></li>" for m in missing)
    body = (
        "<!doctype html><html lang=en><meta charset=utf-8>"
        "<title>elastic-train: dashboard not installed</title>"
        "<body style='font-family:system-ui,sans-serif;max-width:40rem;margin:3rem auto'>"
        "<h1>The dashboard's files are not installed</h1>"
        f"<p>Missing under <code>{html.escape(str(files.root))}</code>:</p>"
        f"<ul>{items}</ul>"
        "<p>In a checkout, run <code>npm ci</code> in <code>dashboards/</code> "
        "(<code>make run</code> does it; it needs Node.js and npm). A wheel carries the "
        "dashboard: install one built from the checkout or its sdist, or set "
        "<code>ETRAIN_DASHBOARD_DIR</code> to a directory holding the dashboard's "
        "<code>app/</code> and the <code>node_modules/</code> that <code>npm ci</code> "
        "installs. "
        "The API works without them: <a href='/docs'>/docs</a>.</p></body></html>"
    )
    return HTMLResponse(body, status_code=503, headers=HEADERS)


def install(app: FastAPI, directory: Path | None = None) -> None:
    files = files_for(directory)
    missing = files.missing()
    if missing:
        log.warning(
            "the dashboard at / cannot work: %s missing under %s (run `npm ci` in "
            "dashboards/, or set ETRAIN_DASHBOARD_DIR)",
            ", ".join(missing),
            files.root,
        )

    @app.get("/", include_in_schema=False)
    def index() -> Response:
        still_missing = files.missing()
        if still_missing:
            return _not_installed_page(files, still_missing)
        return FileResponse(
            files.app / "index.html", headers={**HEADERS, "Cache-Control": "no-cache"}
        )

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:
        # Browsers ask for it on any page (the API's /docs too): a 404 is a console error.
        return FileResponse(
            files.app / "favicon.svg",
            media_type="image/svg+xml",
            headers={**HEADERS, "Cache-Control": "max-age=86400"},
        )

    @app.get("/ui/js/states.js", include_in_schema=False)
    def states() -> Response:
        return Response(
            states_module(),
            media_type="text/javascript",
            headers={**HEADERS, "Cache-Control": "no-cache"},
        )

    # Mounts stay out of the OpenAPI schema. The vendor mounts come first: /ui would
    # otherwise swallow their paths.
    for package in files.packages:
        app.mount(
            f"/ui/vendor/{package}",
            StaticFiles(directory=files.vendor(package), check_dir=False),
            name=f"dashboard-vendor-{package}",
        )
    app.mount("/ui", StaticFiles(directory=files.app, check_dir=False), name="dashboard")
