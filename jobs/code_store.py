"""Where users' code packages are kept: beside the checkpoints, which every Ray node reaches.

Layout: ``<root>/_code/<owner_key>/<id>.tar.gz`` and its ``<id>.json`` (what the check
found: sizes and file count), where ``owner_key`` is the first 32 hex digits of the owner
name's SHA-256, so a user name never becomes a path. ``root`` is a directory or an object
store URI (``s3://``, ``gs://``, ``abfs://``, through ``pyarrow.fs`` as the checkpoints).
A package is written once and never changes: its id is the SHA-256 of its bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from elastic.checkpoint.storage import is_object_uri, join_location
from jobs.code_package import CodePackage

CODE_DIR = "_code"
ARCHIVE_SUFFIX = ".tar.gz"
INFO_SUFFIX = ".json"
_ID = re.compile(r"[0-9a-f]{64}")


def owner_key(owner: str) -> str:
    return hashlib.sha256(owner.encode()).hexdigest()[:32]


def is_package_id(text: str) -> bool:
    """Whether ``text`` has the form of a package id (64 lowercase hex digits)."""
    return _ID.fullmatch(text) is not None


class CodeStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root).rstrip("/") or "/"
        self.remote = is_object_uri(self.root)

    def _relative(self, owner: str, package_id: str, suffix: str = ARCHIVE_SUFFIX) -> str:
        if not is_package_id(package_id):
            raise ValueError(f"{package_id!r} is not a package id")
        return f"{CODE_DIR}/{owner_key(owner)}/{package_id}{suffix}"

    def location(self, owner: str, package_id: str) -> str:
        """Where a worker reads the package: a local path, or a URI under the store's (read
        it through pyarrow.fs with ``compression=None``, which otherwise gunzips a ".gz"
        name on the way out)."""
        relative = self._relative(owner, package_id)
        if self.remote:
            return join_location(self.root, relative)
        return str(Path(self.root) / relative)

    def exists(self, owner: str, package_id: str) -> bool:
        if self.remote:
            return _object_exists(self.location(owner, package_id))
        return os.path.isfile(self.location(owner, package_id))

    def put(
        self, owner: str, package_id: str, data: bytes, info: CodePackage | None = None
    ) -> bool:
        """Store a package (its ``info`` beside it); False when it was there already. The
        info goes first, so a package that exists always has it."""
        target = self.location(owner, package_id)
        if self.exists(owner, package_id):
            return False
        side = self.location(owner, package_id).removesuffix(ARCHIVE_SUFFIX) + INFO_SUFFIX
        info_bytes = json.dumps(_info_dict(info) if info else {}, sort_keys=True).encode()
        if self.remote:
            _object_write(side, info_bytes)
            _object_write(target, data)
            return True
        folder = Path(target).parent
        _private_dirs(folder, Path(self.root))
        _atomic_write(Path(side), info_bytes, replace=True)
        return _atomic_write(Path(target), data, replace=False)

    def info(self, owner: str, package_id: str) -> CodePackage | None:
        """What the check found when the package was stored; None when there is none."""
        if not self.exists(owner, package_id):
            return None
        side = self.location(owner, package_id).removesuffix(ARCHIVE_SUFFIX) + INFO_SUFFIX
        try:
            raw = _object_read(side) if self.remote else Path(side).read_bytes()
            found = json.loads(raw)
            return CodePackage(
                id=package_id,
                size_bytes=int(found["size_bytes"]),
                files=int(found["files"]),
                unpacked_bytes=int(found["unpacked_bytes"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _info_dict(info: CodePackage) -> dict[str, int]:
    return {
        "size_bytes": info.size_bytes,
        "files": info.files,
        "unpacked_bytes": info.unpacked_bytes,
    }


def _private_dirs(folder: Path, root: Path) -> None:
    """Create ``folder`` and the ``_code`` directories above it up to ``root``, 0700: only
    the service (and the workers, as its user) read other users' code."""
    root.mkdir(parents=True, exist_ok=True)
    created = []
    at = folder
    while at != root and not at.exists():
        created.append(at)
        at = at.parent
    for path in reversed(created):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700)  # mkdir's mode is masked by the umask


def _atomic_write(path: Path, data: bytes, *, replace: bool) -> bool:
    """Write ``data`` to a temporary file beside ``path``, then give it the name: a reader
    never sees half a file. Without ``replace``, an existing ``path`` is kept (False)."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)  # fails if another request stored it first
        except FileExistsError:
            return False
        return True
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _object_exists(uri: str) -> bool:
    from pyarrow import fs as pafs

    filesystem, path = pafs.FileSystem.from_uri(uri)
    return bool(filesystem.get_file_info(path).type == pafs.FileType.File)


def _object_write(uri: str, data: bytes) -> None:
    from pyarrow import fs as pafs

    filesystem, path = pafs.FileSystem.from_uri(uri)
    # compression=None: pyarrow would otherwise gzip a ".gz" name again on the way in.
    with filesystem.open_output_stream(path, compression=None) as fh:
        fh.write(data)


def _object_read(uri: str) -> bytes:
    from pyarrow import fs as pafs

    filesystem, path = pafs.FileSystem.from_uri(uri)
    with filesystem.open_input_stream(path, compression=None) as fh:
        return bytes(fh.read())
