"""A directory of training code packed as a tar.gz for ``POST /v1/code``.

What a job never needs is left out: ``.git``, ``__pycache__``, ``*.pyc``, virtual
environments (``.venv``, ``venv`` or any directory holding a ``pyvenv.cfg``) and what the
root's ``.gitignore`` and ``.etrainignore`` exclude (the latter read last, so it can take a
path back in with ``!``).

The archive is deterministic: entries sorted by path, times, owners and names zeroed, modes
0644/0755, no gzip time stamp. The same tree always gives the same bytes, so the same
content id (its SHA-256), and an unchanged directory is never uploaded twice.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import posixpath
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from elastic_train.errors import CodeArchiveError
from elastic_train.ignore_rules import IgnoreRules

IGNORE_FILES = (".gitignore", ".etrainignore")
SKIPPED_DIRS = frozenset({".git", "__pycache__", ".venv", "venv"})
VENV_MARKER = "pyvenv.cfg"
BIGGEST_SHOWN = 5
# Level 6 is zlib's default: most of level 9's ratio for source code, far quicker.
GZIP_LEVEL = 6


@dataclass(frozen=True)
class Packed:
    """A packed directory: the archive's bytes and what went into it."""

    data: bytes
    files: int  # regular files and links (directories not counted)
    unpacked_bytes: int
    biggest: list[tuple[str, int]] = field(default_factory=list)  # (path, size), largest first

    @property
    def size_bytes(self) -> int:
        return len(self.data)

    @property
    def content_id(self) -> str:
        """The id the service gives this archive: the SHA-256 of its bytes."""
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class _Entry:
    path: str  # relative, "/" separated
    kind: str  # "file", "dir" or "link"
    size: int = 0
    executable: bool = False
    target: str = ""


def pack(directory: str | os.PathLike[str]) -> Packed:
    """Pack ``directory`` (see the module's docstring for what is left out). Raises
    :class:`CodeArchiveError` for a missing directory, a link that leaves it, or a file
    that is neither regular, a directory nor a link (a socket, a FIFO)."""
    root = Path(directory)
    if not root.is_dir():
        raise CodeArchiveError(f"{directory}: not a directory")
    entries = sorted(_walk(root, _rules(root)), key=lambda e: e.path)
    data = _archive(root, entries)
    files = [e for e in entries if e.kind != "dir"]
    sized = sorted(((e.path, e.size) for e in files if e.kind == "file"), key=lambda f: -f[1])
    return Packed(
        data=data,
        files=len(files),
        unpacked_bytes=sum(e.size for e in files),
        biggest=sized[:BIGGEST_SHOWN],
    )


def _rules(root: Path) -> IgnoreRules:
    rules = IgnoreRules()
    for name in IGNORE_FILES:
        path = root / name
        if path.is_file():
            rules = rules + IgnoreRules.parse(path.read_text(encoding="utf-8", errors="replace"))
    return rules


def _walk(root: Path, rules: IgnoreRules) -> list[_Entry]:
    real_root = os.path.realpath(root)
    found: list[_Entry] = []
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        with os.scandir(root / rel_dir if rel_dir else root) as listing:
            children = sorted(listing, key=lambda d: d.name)
        for child in children:
            rel = f"{rel_dir}/{child.name}" if rel_dir else child.name
            if child.is_symlink():
                if not rules.ignored(rel, is_dir=False):
                    found.append(_link(root, real_root, rel, child.path))
            elif child.is_dir(follow_symlinks=False):
                if _skipped_dir(child) or rules.ignored(rel, is_dir=True):
                    continue
                found.append(_Entry(rel, "dir"))
                pending.append(rel)
            elif child.is_file(follow_symlinks=False):
                if child.name.endswith(".pyc") or rules.ignored(rel, is_dir=False):
                    continue
                info = child.stat(follow_symlinks=False)
                executable = bool(info.st_mode & (stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH))
                found.append(_Entry(rel, "file", info.st_size, executable))
            elif not rules.ignored(rel, is_dir=False):
                raise CodeArchiveError(
                    f"{rel}: not a regular file, directory or link (a socket or FIFO?); "
                    "leave it out with .etrainignore"
                )
    return found


def _skipped_dir(entry: os.DirEntry[str]) -> bool:
    return entry.name in SKIPPED_DIRS or os.path.exists(os.path.join(entry.path, VENV_MARKER))


def _link(root: Path, real_root: str, rel: str, path: str) -> _Entry:
    """A link kept as a link, with a relative target, if it stays in the tree."""
    target = os.readlink(path)
    if os.path.isabs(target):
        resolved = os.path.realpath(target)
        inside = resolved == real_root or resolved.startswith(real_root + os.sep)
        if not inside:
            raise CodeArchiveError(f"{rel}: a link to {target}, outside the directory")
        target = os.path.relpath(resolved, os.path.dirname(os.path.join(real_root, rel)))
    target = target.replace(os.sep, "/")
    lexical = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
    real = os.path.realpath(path)
    real_inside = real == real_root or real.startswith(real_root + os.sep)
    if lexical == ".." or lexical.startswith("../") or not real_inside:
        raise CodeArchiveError(f"{rel}: a link to {target}, outside the directory")
    return _Entry(rel, "link", target=target)


def _archive(root: Path, entries: list[_Entry]) -> bytes:
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(
            filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=GZIP_LEVEL
        ) as gz,
        tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for entry in entries:
            info = tarfile.TarInfo(entry.path)
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if entry.kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif entry.kind == "link":
                info.type, info.mode, info.linkname = tarfile.SYMTYPE, 0o755, entry.target
                tar.addfile(info)
            else:
                info.mode = 0o755 if entry.executable else 0o644
                with open(root / entry.path, "rb") as fh:
                    info.size = os.fstat(fh.fileno()).st_size
                    tar.addfile(info, fh)
    return buffer.getvalue()
