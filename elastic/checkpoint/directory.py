"""A job's checkpoints: atomic writes, a manifest with checksums, retention that never loses
the newest good one.

A checkpoint ``step_<step>`` is a set of parts plus ``manifest.json`` (the parts' SHA-256
sums), kept by a :class:`CheckpointStorage`. The manifest is written last: until it is
there the checkpoint does not exist, so a reader never sees half of one; its sums catch
what that cannot (a torn copy, bit rot). Retention counts only checkpoints that verify:
a corrupt one is moved aside, never kept in a slot a good one needed.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic.checkpoint.storage import (
    MANIFEST,
    CheckpointStorage,
    is_object_uri,
    local_side_dir,
    sha256_of,
    split_location,
    storage_for,
)

FORMAT_VERSION = 1
_PREFIX = "step_"


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    size_bytes: int
    created_at: float


class CorruptCheckpoint(Exception):
    """Its parts do not match its manifest, or the manifest is unreadable."""


class CheckpointGone(Exception):
    """It is no longer there: retention removed it (a newer one took its slot)."""


@dataclass
class Pruned:
    removed: list[CheckpointInfo] = field(default_factory=list)
    # Corrupt checkpoints taken out of the set: (what it was, why, where it went).
    set_aside: list[tuple[CheckpointInfo, str, str]] = field(default_factory=list)


def steps_to_delete(steps: Iterable[int], keep: int, protect: Iterable[int] = ()) -> list[int]:
    """The valid steps beyond the newest ``keep`` (at least one is always kept), oldest
    first; ``protect`` (the one just written) is never among them."""
    ordered = sorted(set(steps))
    doomed = ordered[: max(0, len(ordered) - max(1, keep))]
    return [s for s in doomed if s not in set(protect)]


def name_for(step: int) -> str:
    return f"{_PREFIX}{step:010d}"


class CheckpointDir:
    """The checkpoints of one job, under ``root`` (a directory, or an object store's URI
    such as ``s3://bucket/prefix/<job>``)."""

    def __init__(
        self, root: str | os.PathLike[str], storage: CheckpointStorage | None = None
    ) -> None:
        self.location = os.fspath(root).rstrip("/") or "/"
        self.remote = is_object_uri(self.location)
        # A local directory for what is kept beside checkpoints (the loop's sample log):
        # the directory itself, or one on this node's disk when checkpoints are in a store.
        self.root = local_side_dir(self.location) if self.remote else Path(root)
        self.storage: CheckpointStorage = storage or storage_for(self.location)
        # name -> the stamps of parts hashed and found matching their manifest: retention
        # does not re-hash gigabytes at every save, yet notices a part changed since.
        self._verified: dict[str, tuple[Any, ...]] = {}

    def path_for(self, step: int) -> str:
        """Where step ``step``'s checkpoint is (a path, or a URI on an object store)."""
        return self.storage.location(name_for(step))

    def _owns(self, location: str) -> bool:
        parent, _ = split_location(location)
        if self.remote or is_object_uri(location):
            return parent.rstrip("/") == self.location
        return Path(parent).resolve() == Path(self.location).resolve()

    def exists(self, location: str | os.PathLike[str]) -> bool:
        """Whether the checkpoint at ``location`` is still in its directory (retention
        removes old ones; a corrupt one is there until it is moved aside)."""
        text = os.fspath(location)
        if not self._owns(text):
            return CheckpointDir(split_location(text)[0]).exists(text)
        return self.storage.present(split_location(text)[1])

    def local_copy(self, location: str | os.PathLike[str]) -> Path:
        """Verify the checkpoint at ``location`` and give a local directory with its
        parts: the checkpoint itself on a filesystem, a verified download from a store."""
        text = os.fspath(location)
        if not self._owns(text):
            return CheckpointDir(split_location(text)[0]).local_copy(text)
        if not self.remote:
            self.verify(text)
            return Path(text)
        name = split_location(text)[1]
        local = self.storage.local_copy(name)
        manifest = self.storage.read_manifest(name)
        if manifest is None and not self.exists(text):
            raise CheckpointGone(f"{name}: removed by retention")
        # Hash what was downloaded (once) rather than reading the store twice.
        verify_files(local, manifest)
        return local

    # -- writing -------------------------------------------------------------------------

    @contextmanager
    def staging(self, step: int, tag: str | None = None) -> Iterator[Path]:
        """A directory to write step ``step``'s parts into (several ranks may share one
        by passing the same ``tag``); publish it with :meth:`publish`."""
        with self.storage.staging(name_for(step), tag or uuid.uuid4().hex[:8]) as staged:
            yield staged

    def publish(self, step: int, staged: Path) -> CheckpointInfo:
        """Hash the staged parts, write the manifest last, and make it step ``step``."""
        files: dict[str, dict[str, Any]] = {}
        for f in sorted(p for p in staged.rglob("*") if p.is_file() and p.name != MANIFEST):
            files[str(f.relative_to(staged))] = {"sha256": sha256_of(f), "size": f.stat().st_size}
        created_at = time.time()
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "created_at": created_at,
            "files": files,
        }
        name = name_for(step)
        self.storage.commit(staged, name, manifest)
        self._verified[name] = self._stamps(name, manifest)
        size = sum(int(v["size"]) for v in files.values())
        return CheckpointInfo(step, self.path_for(step), size, created_at)

    def save(self, step: int, write: Callable[[Path], None]) -> CheckpointInfo:
        """Write a checkpoint: ``write(dir)`` puts the state files in ``dir``."""
        with self.staging(step) as staged:
            write(staged)
            return self.publish(step, staged)

    def clean_orphans(self) -> list[str]:
        """Remove half-written checkpoints a dead writer left (call before writing)."""
        return self.storage.clean_staging()

    # -- reading -------------------------------------------------------------------------

    def existing(self) -> list[CheckpointInfo]:
        """Checkpoints that have a readable manifest, oldest first (checksums not verified)."""
        found = []
        for name in self.storage.names():
            if not name.startswith(_PREFIX):
                continue
            manifest = self.storage.read_manifest(name)
            if not _well_formed(manifest):
                continue
            assert manifest is not None
            size = sum(int(v["size"]) for v in manifest["files"].values())
            found.append(
                CheckpointInfo(
                    int(manifest["step"]),
                    self.storage.location(name),
                    size,
                    float(manifest["created_at"]),
                )
            )
        return sorted(found, key=lambda c: c.step)

    def verify(self, path: str | os.PathLike[str]) -> None:
        """Raise :class:`CorruptCheckpoint` unless every part matches the manifest."""
        text = os.fspath(path)
        name = split_location(text)[1]
        if not self._owns(text):
            # Another job's directory (a checkpoint a new job starts from).
            CheckpointDir(split_location(text)[0]).verify(text)
            return
        manifest = self.storage.read_manifest(name)
        if manifest is None:
            if not self.exists(text):
                raise CheckpointGone(f"{name}: removed by retention")
            raise CorruptCheckpoint(f"{name}: unreadable manifest")
        if not _well_formed(manifest):
            raise CorruptCheckpoint(f"{name}: unknown manifest format")
        for part, meta in manifest["files"].items():
            digest = self.storage.part_digest(name, part)
            if digest is None:
                raise CorruptCheckpoint(f"{name}: {part} is missing")
            if digest != (meta["size"], meta["sha256"]):
                raise CorruptCheckpoint(f"{name}: {part} fails its checksum")
        self._verified[name] = self._stamps(name, manifest)

    def _stamps(self, name: str, manifest: dict[str, Any]) -> tuple[Any, ...]:
        parts = sorted(manifest["files"])
        return (manifest["created_at"], *(self.storage.part_stamp(name, p) for p in parts))

    def _verified_ok(self, info: CheckpointInfo) -> str | None:
        """None when ``info`` verifies (hashed again only when a part changed), else why."""
        name = split_location(info.path)[1]
        manifest = self.storage.read_manifest(name)
        known = self._verified.get(name)
        if known is not None and manifest is not None and known == self._stamps(name, manifest):
            return None
        try:
            self.verify(info.path)
        except CorruptCheckpoint as e:
            return str(e)
        return None

    def latest_valid(self) -> tuple[CheckpointInfo | None, list[tuple[CheckpointInfo, str]]]:
        """The newest checkpoint that verifies (every part hashed now: this picks what a
        job resumes from), and the newer ones skipped with why."""
        skipped: list[tuple[CheckpointInfo, str]] = []
        for info in reversed(self.existing()):
            try:
                self.verify(info.path)
            except CheckpointGone:
                continue  # removed since it was listed: not a corrupt one
            except CorruptCheckpoint as e:
                skipped.append((info, str(e)))
                continue
            return info, skipped
        return None, skipped

    # -- retention -----------------------------------------------------------------------

    def prune(self, keep: int, protect: int | None = None) -> Pruned:
        """Keep the newest ``keep`` checkpoints that verify; corrupt ones are moved aside
        and count for nothing; ``protect`` (the step just written) is never deleted."""
        result = Pruned()
        valid: dict[int, CheckpointInfo] = {}
        for info in self.existing():
            try:
                why = self._verified_ok(info)
            except CheckpointGone:
                continue  # another writer's retention removed it meanwhile
            if why is None:
                valid[info.step] = info
                continue
            name = split_location(info.path)[1]
            try:
                where = self.storage.move_aside(name)
            except OSError:
                continue  # another writer moved or replaced it meanwhile
            self._verified.pop(name, None)
            result.set_aside.append((info, why, where))
        protected = () if protect is None else (protect,)
        for step in steps_to_delete(valid, keep, protected):
            name = split_location(valid[step].path)[1]
            self.storage.remove(name)
            self._verified.pop(name, None)
            result.removed.append(valid[step])
        return result


def verify_files(folder: Path, manifest: dict[str, Any] | None) -> None:
    """Raise :class:`CorruptCheckpoint` unless the files in ``folder`` match ``manifest``."""
    if manifest is None or not _well_formed(manifest):
        raise CorruptCheckpoint(f"{folder.name}: unreadable manifest")
    for part, meta in manifest["files"].items():
        f = folder / part
        if not f.is_file():
            raise CorruptCheckpoint(f"{folder.name}: {part} is missing")
        if (f.stat().st_size, sha256_of(f)) != (meta["size"], meta["sha256"]):
            raise CorruptCheckpoint(f"{folder.name}: {part} fails its checksum")


def _well_formed(manifest: dict[str, Any] | None) -> bool:
    return (
        manifest is not None
        and manifest.get("format") == FORMAT_VERSION
        and isinstance(manifest.get("files"), dict)
        and isinstance(manifest.get("step"), int)
    )
