"""Checkpoints on a shared filesystem: atomic writes, a manifest with checksums, retention.

A checkpoint is a directory ``step_<step>`` holding the state files and ``manifest.json``.
It is written under a temporary name and renamed into place, so a reader never sees half
of one; the manifest's SHA-256 sums catch what the rename cannot (a torn copy, bit rot).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_PREFIX = "step_"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    size_bytes: int
    created_at: float


class CorruptCheckpoint(Exception):
    pass


def steps_to_delete(steps: Iterable[int], keep: int) -> list[int]:
    """The steps beyond the newest ``keep``, oldest first."""
    ordered = sorted(set(steps))
    return ordered[: max(0, len(ordered) - keep)]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointDir:
    """The checkpoints of one job, under ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path_for(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:010d}"

    def save(self, step: int, write: Callable[[Path], None]) -> CheckpointInfo:
        """Write a checkpoint: ``write(tmp_dir)`` puts the state files in ``tmp_dir``."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write(tmp)
            files: dict[str, dict[str, Any]] = {}
            for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
                with f.open("rb") as fh:
                    os.fsync(fh.fileno())
                files[str(f.relative_to(tmp))] = {"sha256": _sha256(f), "size": f.stat().st_size}
            created_at = time.time()
            manifest = {
                "format": FORMAT_VERSION,
                "step": step,
                "created_at": created_at,
                "files": files,
            }
            with (tmp / MANIFEST).open("w") as fh:
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            if final.exists():
                # The same step saved again (a restart that redid it): replace it whole.
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        size = sum(int(v["size"]) for v in files.values())
        return CheckpointInfo(step, str(final), size, created_at)

    def existing(self) -> list[CheckpointInfo]:
        """Checkpoints that have a readable manifest, oldest first (checksums not verified)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            if not entry.name.startswith(_PREFIX) or not entry.is_dir():
                continue
            try:
                manifest = self._manifest(entry)
            except CorruptCheckpoint:
                continue
            size = sum(int(v["size"]) for v in manifest["files"].values())
            found.append(
                CheckpointInfo(int(manifest["step"]), str(entry), size, manifest["created_at"])
            )
        return sorted(found, key=lambda c: c.step)

    def verify(self, path: str | os.PathLike[str]) -> None:
        """Raise :class:`CorruptCheckpoint` unless every file matches the manifest."""
        directory = Path(path)
        manifest = self._manifest(directory)
        for name, meta in manifest["files"].items():
            f = directory / name
            if not f.is_file():
                raise CorruptCheckpoint(f"{directory.name}: {name} is missing")
            if f.stat().st_size != meta["size"] or _sha256(f) != meta["sha256"]:
                raise CorruptCheckpoint(f"{directory.name}: {name} fails its checksum")

    def latest_valid(self) -> tuple[CheckpointInfo | None, list[tuple[CheckpointInfo, str]]]:
        """The newest checkpoint that verifies, and the newer ones skipped with why."""
        skipped: list[tuple[CheckpointInfo, str]] = []
        for info in reversed(self.existing()):
            try:
                self.verify(info.path)
            except CorruptCheckpoint as e:
                skipped.append((info, str(e)))
                continue
            return info, skipped
        return None, skipped

    def prune(self, keep: int) -> list[CheckpointInfo]:
        """Delete all but the newest ``keep`` checkpoints; returns those deleted."""
        existing = {c.step: c for c in self.existing()}
        removed = []
        for step in steps_to_delete(existing, keep):
            shutil.rmtree(existing[step].path, ignore_errors=True)
            removed.append(existing[step])
        return removed

    @staticmethod
    def _manifest(directory: Path) -> dict:
        try:
            with (directory / MANIFEST).open() as fh:
                manifest = json.load(fh)
        except (OSError, ValueError) as e:
            raise CorruptCheckpoint(f"{directory.name}: unreadable manifest ({e})") from e
        if manifest.get("format") != FORMAT_VERSION or "files" not in manifest:
            raise CorruptCheckpoint(f"{directory.name}: unknown manifest format")
        return manifest
