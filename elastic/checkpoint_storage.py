"""Where checkpoints are kept, behind one small interface.

A checkpoint is a named set of parts (files) plus a manifest. The manifest is written
last and is the commit marker: a checkpoint without one does not exist. The local
filesystem stages the parts in a temporary directory and renames it into place; an object
store would upload the parts under the name and put the manifest last, so the same
retention and verification code runs over both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

MANIFEST = "manifest.json"
STAGING_PREFIX = ".tmp-"
CORRUPT_DIR = "corrupt"


class CheckpointStorage(Protocol):
    """The operations retention, verification and the writers need."""

    def names(self) -> list[str]:
        """The committed checkpoints' names (those with a manifest), in no order."""
        ...

    def read_manifest(self, name: str) -> dict[str, Any] | None:
        """The manifest, or None when there is none or it cannot be parsed."""
        ...

    def part_digest(self, name: str, part: str) -> tuple[int, str] | None:
        """(size, SHA-256) of one part, or None when it is missing."""
        ...

    def part_stamp(self, name: str, part: str) -> tuple[int, int] | None:
        """A cheap fingerprint of one part (size, modification time), None when missing:
        a part whose stamp is unchanged since it was hashed need not be hashed again."""
        ...

    def local_path(self, name: str) -> Path:
        """A local directory holding the checkpoint's parts (for readers that need files)."""
        ...

    @contextmanager
    def staging(self, name: str, tag: str) -> Iterator[Path]:
        """A fresh local directory to write parts into; removed if the block raises."""
        ...

    def commit(self, staged: Path, name: str, manifest: dict[str, Any]) -> None:
        """Make ``staged`` the checkpoint ``name``: parts durable, manifest last,
        replacing an existing ``name`` in one step."""
        ...

    def remove(self, name: str) -> None: ...

    def move_aside(self, name: str) -> str:
        """Take a corrupt checkpoint out of the set (kept for a post-mortem); where it went."""
        ...

    def clean_staging(self) -> list[str]:
        """Remove what writers left half-done (a process that died mid-write)."""
        ...


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2``); False where the
    kernel or filesystem cannot."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return rc == 0


class LocalCheckpointStorage:
    """Checkpoints as directories under ``root`` on a filesystem every node mounts."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return [
            e.name
            for e in self.root.iterdir()
            if not e.name.startswith(".") and e.is_dir() and (e / MANIFEST).is_file()
        ]

    def read_manifest(self, name: str) -> dict[str, Any] | None:
        try:
            with (self.root / name / MANIFEST).open() as fh:
                data = json.load(fh)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def part_digest(self, name: str, part: str) -> tuple[int, str] | None:
        path = self.root / name / part
        if not path.is_file():
            return None
        return path.stat().st_size, sha256_of(path)

    def part_stamp(self, name: str, part: str) -> tuple[int, int] | None:
        try:
            st = (self.root / name / part).stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def local_path(self, name: str) -> Path:
        return self.root / name

    @contextmanager
    def staging(self, name: str, tag: str) -> Iterator[Path]:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{STAGING_PREFIX}{name}-{tag}"
        path.mkdir(exist_ok=True)
        try:
            yield path
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def commit(self, staged: Path, name: str, manifest: dict[str, Any]) -> None:
        for f in staged.rglob("*"):
            if f.is_file():
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
        with (staged / MANIFEST).open("w") as fh:
            json.dump(manifest, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        final = self.root / name
        if final.exists() and _exchange(staged, final):
            # The same step saved again (a restart that redid it): readers saw the old one
            # until the swap and the new one after; never neither.
            fsync_dir(self.root)
            shutil.rmtree(staged, ignore_errors=True)
            return
        if final.exists():
            # No atomic swap here: the old one goes aside first (a reader in between
            # falls back to the previous checkpoint, never to a half one).
            old = self.root / f"{STAGING_PREFIX}replaced-{name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(staged, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staged, final)
        fsync_dir(self.root)

    def remove(self, name: str) -> None:
        shutil.rmtree(self.root / name, ignore_errors=True)

    def move_aside(self, name: str) -> str:
        aside = self.root / CORRUPT_DIR
        aside.mkdir(exist_ok=True)
        target = aside / f"{name}-{uuid.uuid4().hex[:8]}"
        os.rename(self.root / name, target)
        return str(target)

    def clean_staging(self) -> list[str]:
        if not self.root.is_dir():
            return []
        removed = []
        for e in self.root.iterdir():
            if e.name.startswith(STAGING_PREFIX) and e.is_dir():
                shutil.rmtree(e, ignore_errors=True)
                removed.append(e.name)
        return sorted(removed)
