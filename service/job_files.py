"""A job's own directory (``ETRAIN_CHECKPOINT_DIR``) as a tar stream, from a filesystem or
a bucket, read a directory at a time and a block at a time: neither the tree nor a large
file is ever held whole.

What is in the directory was written by the owner's code, which may have tried to make the
service read something else. On a filesystem every entry is opened relative to its
directory's descriptor without following symbolic links (``O_NOFOLLOW``), and checked
after it is opened: a link is stored as a link (its target's text, never its content), a
FIFO, socket or device is skipped, and an entry swapped for a link between the listing
and the open is skipped too. A bucket has none of these.

Files may change while they are sent (a running job's). A file of at most :data:`CHUNK`
bytes is read whole before its header is written, so it arrives as one consistent read.
A larger one is sent at the size it had when it was opened: what was appended after that
is left out; a file cut shorter while it is sent cannot be completed and ends the stream,
which the client sees as a download that ended early (keeping nothing).

Uncompressed: the client unpacks it with ``tarfile``, and a model's files do not compress.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import stat
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from elastic.checkpoint.storage import is_object_uri

log = logging.getLogger(__name__)

CHUNK = 1 << 20
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
# Each level holds a directory descriptor and a frame while it is walked: a tree the owner's
# code nested deeper than this is cut there rather than run the service out of either.
MAX_DEPTH = 64

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO put in place of a file between the listing and the open must not hang
# the stream (it is skipped once fstat shows what it is).
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class FileShrank(Exception):
    """A file became shorter than its header said while it was sent."""


def _header(
    name: str, kind: bytes, size: int = 0, mode: int = 0o644, mtime: float = 0, link: str = ""
) -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.mtime = kind, size, mode, int(max(mtime, 0))
    info.linkname = link
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _file(
    name: str, fh: IO[bytes], size_now: Callable[[], int], mode: int, mtime: float
) -> Iterator[bytes]:
    """One regular file's header and content, padded to a whole block."""
    head = fh.read(CHUNK + 1)
    if len(head) <= CHUNK:
        # Read whole: its header says exactly what was read.
        yield _header(name, tarfile.REGTYPE, len(head), mode, mtime)
        yield head + bytes(-len(head) % BLOCK)
        return
    size = size_now()
    yield _header(name, tarfile.REGTYPE, size, mode, mtime)
    block = head[:size]
    left = size - len(block)
    while True:
        yield block
        if left <= 0:
            break
        block = fh.read(min(CHUNK, left))
        if not block:
            raise FileShrank(f"{name} became shorter while it was sent")
        left -= len(block)
    yield bytes(-size % BLOCK)


def _size_of(fd: int) -> int:
    return os.fstat(fd).st_size


def _file_mode(mode: int) -> int:
    # The owner's and everyone's read and execute bits; never set-id or others' write.
    return 0o644 | (mode & 0o111)


def _local_members(dir_fd: int, prefix: str, depth: int) -> Iterator[bytes]:
    try:
        names = sorted(os.listdir(dir_fd))
    except OSError as e:
        log.info("job files: %s is not listed (%s)", prefix, e.strerror)
        return
    for entry in names:
        name = f"{prefix}/{entry}"
        try:
            st = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue  # gone since the listing
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(entry, dir_fd=dir_fd)
            except OSError:
                continue
            yield _header(name, tarfile.SYMTYPE, mode=0o777, mtime=st.st_mtime, link=target)
        elif stat.S_ISDIR(st.st_mode):
            if depth >= MAX_DEPTH:
                log.warning("job files: %s is nested too deep; left out", name)
                continue
            try:
                fd = os.open(entry, _OPEN_DIR, dir_fd=dir_fd)
            except OSError:
                continue  # gone, unreadable, or a link now (ELOOP / ENOTDIR)
            try:
                yield _header(name, tarfile.DIRTYPE, mode=0o755, mtime=st.st_mtime)
                yield from _local_members(fd, name, depth + 1)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode):
            try:
                fd = os.open(entry, _OPEN_FILE, dir_fd=dir_fd)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as fh:
                opened = os.fstat(fd)
                if not stat.S_ISREG(opened.st_mode):
                    continue  # swapped for a FIFO or device since it was listed
                yield from _file(
                    name,
                    fh,
                    functools.partial(_size_of, fd),
                    _file_mode(opened.st_mode),
                    opened.st_mtime,
                )
        # Anything else (a FIFO, a socket, a device) has no content to send.


def _open_root(path: str) -> int | None:
    """The job's directory, never through a link; None when it is not there."""
    try:
        return os.open(path, _OPEN_DIR)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


def _object_members(fs: Any, path: str, prefix: str, depth: int) -> Iterator[bytes]:
    from pyarrow import fs as pafs

    selector = pafs.FileSelector(path, recursive=False, allow_not_found=True)
    for info in sorted(fs.get_file_info(selector), key=lambda i: i.base_name):
        name = f"{prefix}/{info.base_name}"
        mtime = (info.mtime_ns or 0) / 1e9
        if info.type == pafs.FileType.Directory:
            if depth >= MAX_DEPTH:
                log.warning("job files: %s is nested too deep; left out", name)
                continue
            yield _header(name, tarfile.DIRTYPE, mode=0o755, mtime=mtime)
            yield from _object_members(fs, info.path, name, depth + 1)
        elif info.type == pafs.FileType.File:
            try:
                stream = fs.open_input_stream(info.path, compression=None)
            except OSError:
                continue  # removed since the listing
            size = int(info.size or 0)
            with stream:
                yield from _file(name, stream, functools.partial(int, size), 0o644, mtime)


@dataclass(frozen=True)
class JobFiles:
    """A job's directory that holds something, ready to stream under ``top/``."""

    location: str
    top: str

    def chunks(self) -> Iterator[bytes]:
        """The archive, a block of at most about :data:`CHUNK` bytes at a time. A plain
        iterator: Starlette runs it in its thread pool, off the event loop."""
        sent = 0
        for block in self._members():
            sent += len(block)
            yield block
        end = 2 * BLOCK
        yield bytes(end + (-(sent + end) % RECORD))

    def _members(self) -> Iterator[bytes]:
        yield _header(self.top, tarfile.DIRTYPE, mode=0o755)
        if is_object_uri(self.location):
            from pyarrow import fs as pafs

            fs, path = pafs.FileSystem.from_uri(self.location)
            yield from _object_members(fs, path.rstrip("/"), self.top, 1)
            return
        fd = _open_root(self.location)
        if fd is None:
            return  # removed since it was found: an empty archive
        try:
            yield from _local_members(fd, self.top, 1)
        finally:
            os.close(fd)


def find(location: str, top: str) -> JobFiles | None:
    """The job's directory at ``location`` (a path or a URI), or None when it is missing or
    empty: the job wrote nothing there."""
    if is_object_uri(location):
        from pyarrow import fs as pafs

        fs, path = pafs.FileSystem.from_uri(location)
        selector = pafs.FileSelector(path.rstrip("/"), recursive=False, allow_not_found=True)
        return JobFiles(location, top) if fs.get_file_info(selector) else None
    fd = _open_root(location)
    if fd is None:
        return None
    try:
        empty = not os.listdir(fd)
    finally:
        os.close(fd)
    return None if empty else JobFiles(location, top)
