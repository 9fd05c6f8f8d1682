"""A checkpoint as a tar stream: its manifest, then each part, under the checkpoint's name.

Every part is hashed against the manifest before anything is sent (:func:`prepare`), so a
corrupt checkpoint is refused with a problem naming the part instead of being handed over.
The stream hashes each part again as it reads it (a part may change in between) and holds
back the part's last block until its digest matches: a part that no longer matches ends
the stream early, so the client is left with a short archive, never a complete-looking
wrong one. The archive's length is known beforehand (its headers and the manifest's sizes),
so a cut is visible to any HTTP client as a body shorter than its Content-Length.

Uncompressed on purpose: tensors do not compress, and a plain tar is streamed at disk speed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from elastic.checkpoint.storage import MANIFEST, CheckpointStorage

log = logging.getLogger(__name__)

CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE


class CheckpointUnavailable(Exception):
    """The checkpoint is not there (retention removed it)."""


class CheckpointDamaged(Exception):
    """A part, or the manifest, does not match what the manifest says."""

    def __init__(self, part: str, reason: str) -> None:
        super().__init__(f"{part}: {reason}")
        self.part = part
        self.reason = reason


@dataclass(frozen=True)
class Entry:
    part: str
    size: int
    sha256: str


def _padding(size: int) -> int:
    return -size % BLOCK


def safe_part(part: str) -> bool:
    """Whether a manifest's part name stays inside the checkpoint: a relative path without
    ``..`` (a manifest is the job's own writing, and the stream must not read beside it)."""
    path = PurePosixPath(part)
    return (
        bool(part)
        and not path.is_absolute()
        and "\\" not in part
        and all(p not in ("", ".", "..") for p in part.split("/"))
        and part != MANIFEST
    )


def _entries(manifest: Any) -> list[Entry]:
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointDamaged(MANIFEST, "not a checkpoint manifest")
    entries = []
    for part, meta in sorted(manifest["files"].items()):
        try:
            size, digest = int(meta["size"]), str(meta["sha256"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointDamaged(MANIFEST, f"no size and sha256 for {part!r}") from None
        if not safe_part(part) or size < 0:
            raise CheckpointDamaged(MANIFEST, f"names a part outside the checkpoint: {part!r}")
        entries.append(Entry(part, size, digest))
    return entries


@dataclass(frozen=True)
class Archive:
    """One verified checkpoint, ready to stream."""

    storage: CheckpointStorage
    name: str
    manifest: bytes
    entries: list[Entry]
    mtime: int

    def _header(self, path: str, size: int) -> bytes:
        info = tarfile.TarInfo(f"{self.name}/{path}")
        info.size, info.mtime, info.mode = size, self.mtime, 0o644
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def size(self) -> int:
        """The archive's exact length in bytes (its Content-Length)."""
        total = len(self._header(MANIFEST, len(self.manifest)))
        total += len(self.manifest) + _padding(len(self.manifest))
        for e in self.entries:
            total += len(self._header(e.part, e.size)) + e.size + _padding(e.size)
        total += 2 * BLOCK
        return total + (-total % RECORD)

    def chunks(self) -> Iterator[bytes]:
        """The archive, a block of at most :data:`CHUNK` bytes at a time; raises
        :class:`CheckpointDamaged` (ending the stream short) when a part changed since
        :func:`prepare` hashed it."""
        sent = 0
        for block in self._members():
            sent += len(block)
            yield block
        end = 2 * BLOCK
        end += -(sent + end) % RECORD
        yield bytes(end)

    def _members(self) -> Iterator[bytes]:
        yield self._header(MANIFEST, len(self.manifest))
        yield self.manifest + bytes(_padding(len(self.manifest)))
        for e in self.entries:
            yield self._header(e.part, e.size)
            yield from self._part(e)

    def _part(self, e: Entry) -> Iterator[bytes]:
        digest = hashlib.sha256()
        left = e.size
        held = b""
        try:
            fh = self.storage.open_part(self.name, e.part)
        except OSError:
            raise self._changed(e, "is missing") from None
        with fh:
            while left > 0:
                block = fh.read(min(CHUNK, left))
                if not block:
                    raise self._changed(e, f"is {e.size - left} bytes, not {e.size}")
                digest.update(block)
                left -= len(block)
                # The previous block goes out only once another was read: the part's last
                # block waits for its digest.
                if held:
                    yield held
                held = block
            if fh.read(1):
                raise self._changed(e, f"is longer than {e.size} bytes")
        if digest.hexdigest() != e.sha256:
            raise self._changed(e, "fails its checksum")
        yield held + bytes(_padding(e.size))

    def _changed(self, e: Entry, what: str) -> CheckpointDamaged:
        log.warning(
            "checkpoint %s: %s %s while it was sent; the stream ends short", self.name, e.part, what
        )
        return CheckpointDamaged(e.part, f"{what} (changed while it was sent)")


def prepare(storage: CheckpointStorage, name: str) -> Archive:
    """Read the manifest and hash every part against it: the archive to stream, or
    :class:`CheckpointUnavailable` / :class:`CheckpointDamaged` naming what is wrong."""
    try:
        with storage.open_part(name, MANIFEST) as fh:
            raw = fh.read()
    except OSError:
        if not storage.present(name):
            raise CheckpointUnavailable(name) from None
        raise CheckpointDamaged(MANIFEST, "is missing") from None
    try:
        manifest = json.loads(raw)
    except ValueError:
        raise CheckpointDamaged(MANIFEST, "is not JSON") from None
    entries = _entries(manifest)
    for e in entries:
        found = storage.part_digest(name, e.part)
        if found is None:
            raise CheckpointDamaged(e.part, "is missing")
        size, digest = found
        if size != e.size:
            raise CheckpointDamaged(e.part, f"is {size} bytes, the manifest says {e.size}")
        if digest != e.sha256:
            raise CheckpointDamaged(e.part, "fails its checksum (SHA-256)")
    created = manifest.get("created_at")
    mtime = int(created) if isinstance(created, int | float) else 0
    return Archive(storage, name, raw, entries, mtime)
