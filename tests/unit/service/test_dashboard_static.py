"""The dashboard's static files at / and /ui: no token, out of the OpenAPI schema, no route
shadowed, and a clear page when npm has not installed the chart library. No Ray needed:
the app's lifespan (which connects to Ray) is not entered."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from elastic.job_state import TERMINAL_STATES, JobState
from service import dashboard
from service.app import create_app
from tests.conftest import make_settings


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    return TestClient(create_app(make_settings(tmp_path)))


def test_the_app_and_its_library_are_served_without_a_token(client: TestClient) -> None:
    assert dashboard.missing_dependencies() == [], "run `npm ci` in dashboards/ (make test does)"
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert '<script type="module" src="ui/js/main.js">' in page.text
    script = client.get("/ui/js/main.js")
    assert script.status_code == 200
    assert "javascript" in script.headers["content-type"]
    library = client.get("/ui/vendor/uplot/uPlot.esm.js")
    assert library.status_code == 200 and "export" in library.text
    assert client.get("/ui/vendor/uplot/package.json").status_code == 404  # dist/ only
    assert client.get("/ui/nope.js").status_code == 404


def test_the_dashboard_s_job_states_are_the_state_machine_s(
    client: TestClient, tmp_path: Path
) -> None:
    """The browser's module of states is generated from elastic/job_state.py: run by Node,
    it holds every state in order and exactly the terminal ones."""
    served = client.get("/ui/js/states.js")
    assert served.status_code == 200
    assert "javascript" in served.headers["content-type"]
    module = tmp_path / "states.mjs"
    module.write_text(served.text)
    script = (
        f"import {{ STATES, TERMINAL }} from {json.dumps(module.as_uri())};"
        "console.log(JSON.stringify([STATES, [...TERMINAL]]));"
    )
    out = subprocess.run(
        ["node", "--input-type=module", "-e", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    states, terminal = json.loads(out)
    assert states == [s.value for s in JobState]
    assert set(terminal) == {s.value for s in TERMINAL_STATES}
    assert 'export { STATES, TERMINAL } from "./states.js";' in client.get("/ui/js/format.js").text


def test_the_icon_is_served_where_browsers_ask_for_it(client: TestClient) -> None:
    """A 404 at /favicon.ico is a console error on every page load."""
    page = client.get("/")
    assert '<link rel="icon" href="ui/favicon.svg" type="image/svg+xml">' in page.text
    for path in ("/favicon.ico", "/ui/favicon.svg"):
        icon = client.get(path)
        assert icon.status_code == 200, path
        assert icon.headers["content-type"].startswith("image/svg+xml")
        assert icon.text.startswith("<svg ")


def test_the_dashboard_stays_out_of_the_schema_and_shadows_nothing(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    outside = ("/healthz", "/readyz", "/metrics")
    assert not [p for p in paths if not p.startswith("/v1/") and p not in outside]
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/docs").status_code == 200
    assert client.get("/v1/jobs").status_code == 401  # the API still wants its token
    assert client.get("/v1/cluster").status_code == 401
    assert client.get("/metrics").status_code == 401


def test_without_npm_ci_the_page_says_what_to_run(tmp_path: Path) -> None:
    """A directory with the app but without the npm packages: / says what is missing and
    how to install it, and the API still answers."""
    import shutil

    shutil.copytree(dashboard.SOURCE_TREE_DIR / "app", tmp_path / "dash" / "app")
    settings = make_settings(tmp_path / "data", dashboard_dir=tmp_path / "dash")
    client = TestClient(create_app(settings))
    page = client.get("/")
    assert page.status_code == 503
    assert "<code>npm ci</code> in <code>dashboards/</code>" in page.text
    assert "ETRAIN_DASHBOARD_DIR" in page.text
    assert "node_modules/uplot/dist/uPlot.esm.js" in page.text
    assert client.get("/healthz").status_code == 200


def _copy_of_the_dashboard(root: Path, mark: str) -> Path:
    """The checkout's dashboard laid out under ``root``, its page's title marked."""
    import shutil

    shutil.copytree(dashboard.SOURCE_TREE_DIR / "app", root / "app")
    shutil.copytree(
        dashboard.SOURCE_TREE_DIR / "node_modules" / "uplot" / "dist",
        root / "node_modules" / "uplot" / "dist",
    )
    (root / "app" / "index.html").write_text(
        (root / "app" / "index.html").read_text().replace("<title>", f"<title>{mark} ")
    )
    return root


def test_a_configured_dashboard_dir_is_served(tmp_path: Path) -> None:
    """ETRAIN_DASHBOARD_DIR: the app and its library come from there, not from the source
    tree."""
    root = _copy_of_the_dashboard(tmp_path / "dash", "copied")
    client = TestClient(create_app(make_settings(tmp_path / "data", dashboard_dir=root)))
    page = client.get("/")
    assert page.status_code == 200 and "<title>copied " in page.text
    assert client.get("/ui/vendor/uplot/uPlot.min.css").status_code == 200


def test_a_wheels_own_copy_comes_before_the_source_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed wheel (the image's too) carries the dashboard in the package, laid out
    by setup.py's build hook: served when ETRAIN_DASHBOARD_DIR is unset, which still wins
    over it. The checkout's editable install carries none: the hook writes only into the
    build directory."""
    assert dashboard.packaged_dir() is None
    packaged = _copy_of_the_dashboard(tmp_path / "packaged", "packaged")
    monkeypatch.setattr(dashboard, "packaged_dir", lambda: packaged)
    page = TestClient(create_app(make_settings(tmp_path / "one"))).get("/")
    assert page.status_code == 200 and "<title>packaged " in page.text
    configured = _copy_of_the_dashboard(tmp_path / "configured", "configured")
    settings = make_settings(tmp_path / "two", dashboard_dir=configured)
    page = TestClient(create_app(settings)).get("/")
    assert page.status_code == 200 and "<title>configured " in page.text
