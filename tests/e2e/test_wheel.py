"""`pip install` of a wheel gives a working dashboard (the image's build of one is
test_installed_service's).

The wheel is built as from a fresh clone: the sdist of the checkout's files (node_modules is
git-ignored, so not among them), then pip's wheel of that sdist, so that setup.py's hook
runs `npm ci` itself, in the build's temporary directory (npm's cache makes that quick after
the first time). It is installed into a fresh virtual environment whose third-party
packages come from this run's environment through a path file (nothing is downloaded), and
the installed app is served by uvicorn from a directory that holds no source. Its lifespan,
which starts or joins Ray, is left out: the dashboard's routes need no Ray, and
test_installed_service starts a whole `etrain serve` of such an install. Without npm and
without node_modules the wheel's build fails and says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import TOKEN, free_port, wait_for
from tests.e2e.test_image_recipe import ROOT

PACKAGED = "service/dashboard_files/"
NO_NPM = "npm (Node.js 18+) is not on PATH"


@dataclass(frozen=True)
class Built:
    sources: Path
    sdist: Path
    wheel: Path


def _pip(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )


def _clean_env() -> dict[str, str]:
    """This process's environment without the test session's service and Ray settings, nor
    a PYTHONPATH that would put the checkout ahead of the installed package."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ETRAIN_", "RAY_")) and k != "PYTHONPATH"
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    base = tmp_path_factory.mktemp("wheel")
    sources = base / "sources"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if src.is_file():  # not a file deleted in the working tree
            (sources / name).parent.mkdir(parents=True, exist_ok=True)
            (sources / name).write_bytes(src.read_bytes())
    assert not (sources / "dashboards" / "node_modules").exists()
    dist = base / "dist"
    # What `python -m build --sdist --no-isolation` calls.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
            str(dist),
        ],
        cwd=sources,
        check=True,
        capture_output=True,
    )
    (sdist,) = dist.glob("*.tar.gz")
    # --no-build-isolation: the build uses this environment's setuptools, nothing fetched.
    made = _pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        str(dist),
        str(sdist),
        cwd=base,
        env=_clean_env(),
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    return Built(sources, sdist, wheel)


def test_the_sdist_carries_the_dashboards_sources_and_the_wheel_its_files(built: Built) -> None:
    with tarfile.open(built.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert {"setup.py", "dashboards/package.json", "dashboards/package-lock.json"} <= names
    assert "dashboards/app/index.html" in names
    assert not [n for n in names if "node_modules" in n]

    app = built.sources / "dashboards" / "app"
    expected = {f"app/{p.relative_to(app)}" for p in app.rglob("*") if p.is_file()}
    # What the app loads from npm, and the licence that comes with it (not served: only
    # dist/ is mounted).
    expected |= {
        "node_modules/uplot/dist/uPlot.esm.js",
        "node_modules/uplot/dist/uPlot.min.css",
        "node_modules/uplot/LICENSE",
    }
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        recorded = {line.split(",")[0] for line in wheel.read(record).decode().splitlines()}
    packaged = {n.removeprefix(PACKAGED) for n in names if n.startswith(PACKAGED)}
    assert packaged == expected
    assert {PACKAGED + n for n in expected} <= recorded


@pytest.fixture(scope="module")
def served(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """The wheel installed into a fresh venv and its app served from outside the checkout;
    yields its URL and the venv's site-packages."""
    base = tmp_path_factory.mktemp("installed")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    python = str(venv / "bin" / "python")
    # Installed before the path file below, away from the checkout and its PYTHONPATH: pip
    # would otherwise find this run's own elastic-train and call the wheel installed already.
    done = _pip(
        "--python",
        python,
        "install",
        "--no-deps",
        "--no-index",
        "-q",
        str(built.wheel),
        cwd=base,
        env=_clean_env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Third-party packages from this run's environment; not its .pth files (which would put
    # the editable checkout back on the path).
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = _clean_env()
    root = subprocess.run(
        [python, "-c", "from service import dashboard; print(dashboard.files_for(None).root)"],
        cwd=base,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert root == str(site / "service" / "dashboard_files"), root
    port = free_port()
    env |= {"ETRAIN_DATA_DIR": str(base / "data"), "ETRAIN_API_TOKEN": TOKEN}
    log = base / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                python,
                "-m",
                "uvicorn",
                "--factory",
                "service.app:create_app",
                # No Ray (see the module's docstring).
                "--lifespan",
                "off",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            cwd=base,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, timeout=60, interval=0.2, what="the installed app to answer")
        yield url, site
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_installed_wheel_serves_the_dashboard_outside_the_checkout(
    served: tuple[str, Path],
) -> None:
    url, site = served
    page = httpx.get(f"{url}/")
    assert page.status_code == 200, page.text[:500]
    assert page.text == (site / "service" / "dashboard_files" / "app" / "index.html").read_text()
    assert '<script type="module" src="ui/js/main.js">' in page.text
    assert httpx.get(f"{url}/ui/js/main.js").status_code == 200
    library = httpx.get(f"{url}/ui/vendor/uplot/uPlot.esm.js")
    assert library.status_code == 200 and "export" in library.text
    assert httpx.get(f"{url}/ui/vendor/uplot/uPlot.min.css").status_code == 200
    assert httpx.get(f"{url}/ui/vendor/uplot/uPlot.cjs.js").status_code == 404  # not carried


def test_without_npm_the_wheel_build_fails_and_says_why(built: Built, tmp_path: Path) -> None:
    """No node_modules in the sdist and no npm on PATH: no wheel, and the reason."""
    env = _clean_env() | {"PATH": str(tmp_path / "no-bin")}
    failed = _pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        str(tmp_path),
        str(built.sdist),
        cwd=tmp_path,
        env=env,
    )
    assert failed.returncode != 0
    assert NO_NPM in failed.stdout + failed.stderr, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert not list(tmp_path.glob("*.whl"))
