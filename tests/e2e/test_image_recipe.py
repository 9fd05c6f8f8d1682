"""The container image recipe, helm/Dockerfile, read without a Docker engine.

It is built with the repository root as its context, so every path it copies must exist
there (and pass its .dockerignore), the command it runs must be the service's console
script, and it must not run as root.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from pathlib import Path

from service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "helm" / "Dockerfile"
DOCKERIGNORE = ROOT / "helm" / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        result.append((word.upper(), rest.strip()))
    assert pending == "", "the Dockerfile ends inside a continued line"
    return result


def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each build stage (ARGs before the first FROM are dropped)."""
    found: list[list[tuple[str, str]]] = []
    for word, rest in instructions():
        if word == "FROM":
            found.append([])
        if found:
            found[-1].append((word, rest))
    return found


def copy_sources(args: str) -> list[str] | None:
    """The sources of a COPY from the build context; None for COPY --from=<stage>."""
    words = shlex.split(args)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return None
    paths = [w for w in words if not w.startswith("--")]
    assert len(paths) >= 2, f"COPY needs a source and a destination: {args}"
    return paths[:-1]


def context_sources() -> list[str]:
    sources: list[str] = []
    for word, rest in instructions():
        if word in {"COPY", "ADD"}:
            assert word == "COPY", "use COPY, not ADD"
            copied = copy_sources(rest)
            if copied is not None:
                sources.extend(copied)
    return sources


def exec_form(args: str) -> list[str]:
    command = json.loads(args)
    assert isinstance(command, list), "use the exec (JSON) form"
    return command


def test_every_copied_path_exists_in_the_build_context() -> None:
    sources = context_sources()
    assert sources == [
        "dashboards/package.json",
        "dashboards/package-lock.json",
        "dashboards/app",
        "constraints.txt",
        "pyproject.toml",
        "setup.py",
        "README.md",
        "service",
        "jobs",
        "elastic",
        "elastic_train",
    ]
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert missing == []
    # Every package the distribution installs is in the image (the console script's too).
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    packages = [pattern.rstrip("*") for pattern in find["find"]["include"]]
    assert set(packages) <= set(sources)


def test_copied_paths_pass_the_dockerignore() -> None:
    """A `*` allow-list: each copied path must be let back in by a `!` line."""
    lines = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[0] == "*"
    for source in context_sources():
        included = False
        for pattern in lines:
            negated = pattern.startswith("!")
            if fnmatch.fnmatch(source, pattern.removeprefix("!")):
                included = negated
        assert included, f"{source} is excluded by {DOCKERIGNORE.name}"


def test_the_project_is_installed_with_its_pins() -> None:
    runs = [rest for word, rest in instructions() if word == "RUN" and "pip install" in rest]
    assert len(runs) == 2
    assert all("-c constraints.txt" in run for run in runs)
    assert '".[postgres]"' in runs[-1]
    # The package the image installs is the one pyproject declares.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "elastic-train"
    assert "postgres" in project["optional-dependencies"]
    pins = (ROOT / "constraints.txt").read_text()
    assert re.search(r"^torch==", pins, re.M)
    assert re.search(r"^torchvision==", pins, re.M)


def test_cpu_by_default_cuda_by_build_argument() -> None:
    args = [rest for word, rest in instructions() if word == "ARG"]
    assert "TORCH_VARIANT=cpu" in args
    runs = [rest for word, rest in instructions() if word == "RUN" and "torch torchvision" in rest]
    assert len(runs) == 1
    assert "https://download.pytorch.org/whl/${TORCH_VARIANT}" in runs[0]


def test_it_runs_the_service_console_script_as_non_root() -> None:
    final = stages()[-1]
    commands = [exec_form(rest) for word, rest in final if word == "CMD"]
    entrypoints = [rest for word, rest in final if word == "ENTRYPOINT"]
    assert entrypoints == []
    assert commands == [["etrain", "serve"]]

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    target = scripts[commands[0][0]]
    module, _, function = target.partition(":")
    assert (module, function) == ("elastic_train.cli", "main")
    source = ROOT / Path(*module.split(".")).with_suffix(".py")
    assert source.is_file(), f"{target} names a module that does not exist"
    assert re.search(rf"^def {function}\(", source.read_text(), re.M)

    users = [rest for word, rest in final if word == "USER"]
    assert users == ["1000:1000"]
    assert [rest for word, rest in final if word == "EXPOSE"] == ["8000"]


def test_image_environment_names_real_settings() -> None:
    env: dict[str, str] = {}
    for word, rest in stages()[-1]:
        if word == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    etrain = {
        n.removeprefix("ETRAIN_").lower(): v for n, v in env.items() if n.startswith("ETRAIN_")
    }
    assert set(etrain) <= set(Settings.model_fields)
    assert etrain == {
        "host": "0.0.0.0",
        "port": "8000",
        "data_dir": "/var/lib/etrain",
    }
