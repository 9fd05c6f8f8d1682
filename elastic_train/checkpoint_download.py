"""A downloaded checkpoint archive, unpacked and checked on the client's side.

The service checks every part before it sends one, but what arrives has crossed a network
and a disk: the client hashes each part again against the manifest that came with it, and
keeps nothing unless all of them match. The archive and its unpacked parts are staged in a
hidden directory beside the destination (the same filesystem, so the last step is one
rename) that is removed whatever happens.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from elastic_train.errors import CheckpointCorrupt, ElasticTrainError, NoCheckpoint
from elastic_train.models import Checkpoint

MANIFEST = "manifest.json"
ARCHIVE = "checkpoint.tar"


def newest_step(job_id: str, checkpoints: list[Checkpoint]) -> int:
    """The newest checkpoint's step (the list is oldest first, as the API gives it)."""
    if not checkpoints:
        raise NoCheckpoint(f"job {job_id} has no checkpoints yet")
    return max(c.step for c in checkpoints)


def destination(into: str | os.PathLike[str], job_id: str, step: int) -> Path:
    """``into/<job_id>-step-<step>``; an existing one is never overwritten."""
    dest = Path(into) / f"{job_id}-step-{step}"
    if dest.exists():
        raise ElasticTrainError(f"{dest} already exists; remove it or download into another -o")
    return dest


@contextmanager
def staging(dest: Path) -> Iterator[Path]:
    """A hidden directory beside ``dest`` for the archive and its unpacking, removed on
    the way out (what succeeded was renamed out of it first)."""
    if not hasattr(tarfile, "data_filter"):
        raise ElasticTrainError("unpacking an archive safely needs Python 3.11.4 or newer")
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _manifest(root: Path) -> dict[str, Any]:
    try:
        data = json.loads((root / MANIFEST).read_bytes())
    except (OSError, ValueError):
        raise CheckpointCorrupt(MANIFEST, "is missing or not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise CheckpointCorrupt(MANIFEST, "is not a checkpoint manifest")
    return data


def verify(root: Path) -> dict[str, Any]:
    """Every part under ``root`` has its manifest's size and SHA-256, and nothing else is
    there; the manifest, or :class:`CheckpointCorrupt` naming the first part that differs."""
    manifest = _manifest(root)
    files: dict[str, Any] = manifest["files"]
    for part, meta in sorted(files.items()):
        path = root / part
        if not path.resolve().is_relative_to(root.resolve()) or not path.is_file():
            raise CheckpointCorrupt(part, "is missing")
        size = path.stat().st_size
        if size != meta.get("size"):
            raise CheckpointCorrupt(part, f"is {size} bytes, the manifest says {meta.get('size')}")
        if _sha256(path) != meta.get("sha256"):
            raise CheckpointCorrupt(part, "fails its checksum (SHA-256)")
    found = {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir()}
    extra = sorted(found - set(files) - {MANIFEST})
    if extra:
        raise CheckpointCorrupt(extra[0], "is not in the manifest")
    return manifest


def unpack(archive: Path, stage: Path, dest: Path) -> Path:
    """Unpack ``archive`` (in ``stage``) safely, check it, and move it to ``dest``."""
    out = stage / "unpacked"
    try:
        with tarfile.open(archive, "r:") as tar:
            # "data": no absolute paths, no links out, no devices, no setuid bits.
            tar.extractall(out, filter="data")
    except (tarfile.TarError, EOFError) as e:
        raise CheckpointCorrupt("the archive", f"is unreadable ({e})") from None
    tops = list(out.iterdir()) if out.is_dir() else []
    if len(tops) != 1 or not tops[0].is_dir():
        raise CheckpointCorrupt("the archive", "does not hold one checkpoint directory")
    verify(tops[0])
    os.rename(tops[0], dest)
    return dest
