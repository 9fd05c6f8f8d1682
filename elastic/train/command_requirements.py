"""A command job's requirements: the spec's ``requirements`` and the package's
``requirements.txt``, installed by pip into a directory of their own on each node, once per
owner and set of requirements, and put on the command's ``PYTHONPATH``.

pip runs confined as the command does (it is the user's choice of code, and a package's
build runs code), as the owner's uid, writing only its target; it reaches the network. The
workers' own environment is never changed: what a user installs can shadow nothing of the
worker's (Ray's ``runtime_env`` ``pip`` would install into the worker's own interpreter).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

REQUIREMENTS_FILE = "requirements.txt"
# One directory per node for every job's installs, passable by the owners' uids; each
# install is its owner's uid's alone.
DEPS_ROOT = Path(tempfile.gettempdir()) / "etrain-deps"


def pip_arguments(requirements: Sequence[str], workdir: Path) -> list[str]:
    """What pip installs for the job (empty: nothing)."""
    args = list(requirements)
    if (workdir / REQUIREMENTS_FILE).is_file():
        args += ["-r", REQUIREMENTS_FILE]
    return args


def install_key(owner: str, args: Sequence[str], workdir: Path) -> str:
    """Names an install: its owner, what it installs, and the requirements file's text."""
    digest = hashlib.sha256(json.dumps([owner, list(args)]).encode())
    if (workdir / REQUIREMENTS_FILE).is_file():
        digest.update((workdir / REQUIREMENTS_FILE).read_bytes())
    digest.update(sys.version.encode())  # an install is for one interpreter
    return digest.hexdigest()[:24]


def pip_command(target: Path, args: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--target",
        str(target),
        "--no-input",
        "--disable-pip-version-check",
        "--no-warn-script-location",
        "--progress-bar",
        "off",
        *args,
    ]


def staging(key: str, uid: int | None) -> tuple[Path, Path]:
    """(where pip installs, where the finished install goes): the first is the owner's."""
    DEPS_ROOT.mkdir(parents=True, exist_ok=True)
    DEPS_ROOT.chmod(0o711)
    stage = DEPS_ROOT / f".{key}-{uuid.uuid4().hex[:8]}"
    stage.mkdir(mode=0o700)
    if uid is not None:
        os.chown(stage, uid, uid)
    return stage, DEPS_ROOT / key


def publish(stage: Path, final: Path) -> None:
    """The install in place; another worker of this node that finished first keeps its."""
    try:
        stage.rename(final)
    except OSError:
        shutil.rmtree(stage, ignore_errors=True)
