"""The build hook that puts the web dashboard into the wheel; the rest is pyproject.toml.

A wheel (``pip install .``, ``pip wheel .``, a wheel built from the sdist) carries the
dashboard under ``service/dashboard_files/``: the app from dashboards/app and, of each npm
package it loads, the files it loads (service/dashboard_assets.py names them) with the
package's licence. They come from dashboards/node_modules when it holds exactly the
versions dashboards/package-lock.json pins (after `make run` or the image's node stage),
otherwise from an `npm ci` run in the build's temporary directory, which leaves the
checkout's node_modules alone. With neither, the build fails and says why: a wheel without
its dashboard would answer 503 at / wherever it is installed.

An editable install (``pip install -e .``, what `make` does) copies nothing and needs no
npm: the service serves the checkout's dashboards/ itself. None of the built files is
committed; they exist only in the build directory and the wheel.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import ExecError, SetupError

ROOT = Path(__file__).resolve().parent
SOURCE = ROOT / "dashboards"
NPM_CI = ("ci", "--omit=dev", "--no-audit", "--no-fund")


def _assets() -> ModuleType:
    # Loaded by path: the build environment may lack the service package's dependencies,
    # and this module needs none.
    spec = importlib.util.spec_from_file_location(
        "_etrain_dashboard_assets", ROOT / "service" / "dashboard_assets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _installed_as_locked(source: Path) -> bool:
    """Whether source/node_modules holds every package at the version the lock pins."""
    lock = json.loads((source / "package-lock.json").read_text())
    for key, entry in lock["packages"].items():
        if not key.startswith("node_modules/") or entry.get("dev") or "version" not in entry:
            continue
        manifest = source / key / "package.json"
        if not manifest.is_file():
            return False
        if json.loads(manifest.read_text()).get("version") != entry["version"]:
            return False
    return True


def _npm_ci(source: Path, scratch: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise SetupError(
            "the wheel carries the web dashboard, whose chart library comes from npm, but "
            f"{source / 'node_modules'} does not hold the versions "
            "dashboards/package-lock.json pins and npm (Node.js 18+) is not on PATH. "
            "Install Node.js and npm, or run `npm ci` in dashboards/, and build again. "
            "(An editable install, `pip install -e .`, needs neither.)"
        )
    work = scratch / "dashboard-npm"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    for name in ("package.json", "package-lock.json"):
        shutil.copy2(source / name, work / name)
    try:
        subprocess.run([npm, *NPM_CI], cwd=work, check=True)
    except subprocess.CalledProcessError as e:
        raise ExecError(f"`npm {' '.join(NPM_CI)}` in {work} failed ({e.returncode})") from e
    return work / "node_modules"


def build_dashboard(source: Path, target: Path, scratch: Path) -> list[str]:
    """Lay out the dashboard directory ``target`` (app/ and node_modules/<pkg>/dist/...)
    from the sources under ``source``; returns the files written."""
    needed = ["app/index.html", "package.json", "package-lock.json"]
    absent = [name for name in needed if not (source / name).is_file()]
    if absent:
        raise SetupError(
            f"the web dashboard's sources are missing under {source}: {', '.join(absent)}. "
            "Build from a checkout or from the sdist, which carry dashboards/."
        )
    assets = _assets()
    modules = source / "node_modules" if _installed_as_locked(source) else None
    if modules is None:
        modules = _npm_ci(source, scratch)
    # A build directory reused from an earlier build may hold files the app has since lost.
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source / "app", target / "app")
    for name in assets.VENDOR_FILES:
        package, file = name.split("/", 1)
        src = modules / package / "dist" / file
        if not src.is_file():
            raise SetupError(f"npm installed no {src}: does package-lock.json pin {package}?")
        dest = target / "node_modules" / package / "dist" / file
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
    for package in assets.vendor_packages():
        # The licences (uPlot's is MIT) ask that copies carry them; outside dist/, so the
        # service does not serve them.
        for notice in (modules / package).glob("LICEN[CS]E*"):
            shutil.copy2(notice, target / "node_modules" / package / notice.name)
    return [str(path) for path in sorted(target.rglob("*")) if path.is_file()]


class BuildPyWithDashboard(build_py):  # type: ignore[misc]  # setuptools has no type hints
    """build_py, plus the dashboard's files into <build_lib>/service/dashboard_files."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.dashboard_outputs: list[str] = []

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        target = Path(self.build_lib) / "service" / _assets().PACKAGE_DIR
        scratch = Path(self.get_finalized_command("build").build_temp)
        self.dashboard_outputs = build_dashboard(SOURCE, target, scratch)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), *self.dashboard_outputs]


setup(cmdclass={"build_py": BuildPyWithDashboard})
