"""The check a code package (a user's tar.gz of training code) passes before it is stored.

Pure: bytes in, a verdict out. A package is refused, naming the entry and the rule, when
unpacking it could write outside its directory or make anything but plain files,
directories and links that stay inside: an absolute path, a ``..`` component, a path that
passes through a link, a link whose target leaves the tree, a device or FIFO. Sizes are
checked while reading, so a zip bomb is refused once it passes the limit, never inflated.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import posixpath
import tarfile
import zlib
from dataclasses import dataclass

GZIP_MAGIC = b"\x1f\x8b"
# Decompressed bytes allowed per entry beyond the files' contents: its header, a long
# name's extra header and the padding (a header that claims more is not a code package).
HEADER_ALLOWANCE = 8192
# Links followed within one path before it counts as a loop.
MAX_LINK_HOPS = 40


@dataclass(frozen=True)
class PackageLimits:
    max_files: int
    max_unpacked_bytes: int


@dataclass(frozen=True)
class CodePackage:
    """An accepted package: ``id`` is the SHA-256 (hex) of its bytes."""

    id: str
    size_bytes: int
    files: int  # regular files and links
    unpacked_bytes: int


class PackageRefused(ValueError):
    """Why a package is refused; ``entry`` is the archive member at fault, if one is."""

    def __init__(self, message: str, entry: str | None = None, rule: str = "invalid") -> None:
        self.message, self.entry, self.rule = message, entry, rule
        super().__init__(f"{entry}: {message}" if entry else message)


def content_id(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check(data: bytes, limits: PackageLimits) -> CodePackage:
    """The package's id and sizes, or :class:`PackageRefused`."""
    if not data.startswith(GZIP_MAGIC):
        raise PackageRefused("the body is not a gzip-compressed tar archive", rule="format")
    cap = limits.max_unpacked_bytes + HEADER_ALLOWANCE * (limits.max_files + 1)
    stream = _CappedReader(gzip.GzipFile(fileobj=io.BytesIO(data)), cap)
    entries = _Entries(limits)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                entries.add(member)
    except _OverCap:
        raise PackageRefused(
            f"unpacks to more than max_unpacked_bytes ({limits.max_unpacked_bytes} bytes)",
            entries.last,
            rule="max_unpacked_bytes",
        ) from None
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise PackageRefused(
            f"the body is not a gzip-compressed tar archive ({e})", entries.last, rule="format"
        ) from None
    entries.check_links()
    return CodePackage(content_id(data), len(data), entries.files, entries.unpacked)


class _OverCap(Exception):
    pass


class _CappedReader(io.RawIOBase):
    """The decompressed stream, cut off past ``cap`` bytes."""

    def __init__(self, inner: gzip.GzipFile, cap: int) -> None:
        self.inner, self.cap, self.seen = inner, cap, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        chunk = self.inner.read(size)
        self.seen += len(chunk)
        if self.seen > self.cap:
            raise _OverCap
        return chunk


class _Entries:
    """The members seen so far, each checked as it comes."""

    def __init__(self, limits: PackageLimits) -> None:
        self.limits = limits
        self.count = 0
        self.files = 0
        self.unpacked = 0
        self.last: str | None = None
        self.symlinks: dict[str, str] = {}  # path -> target, as written
        self.hardlinks: dict[str, str] = {}
        self.paths: list[str] = []

    def add(self, member: tarfile.TarInfo) -> None:
        name = member.name
        self.last = name
        self.count += 1
        if self.count > self.limits.max_files:
            raise PackageRefused(
                f"more than max_files ({self.limits.max_files}) entries", name, "max_files"
            )
        if member.isdir() and _is_root(name):
            return  # "./", as `tar -C dir .` writes first: the package's own directory
        path = _relative_path(name, "path")
        if member.issym() or member.islnk():
            if not member.linkname:
                raise PackageRefused("a link without a target", name, "link")
            if member.linkname.startswith("/"):
                raise PackageRefused(
                    f"a link to the absolute path {member.linkname!r}", name, "link"
                )
            (self.symlinks if member.issym() else self.hardlinks)[path] = member.linkname
            self.files += 1
        elif member.isreg():
            self.files += 1
            self.unpacked += member.size
            if self.unpacked > self.limits.max_unpacked_bytes:
                raise PackageRefused(
                    f"unpacks to more than max_unpacked_bytes "
                    f"({self.limits.max_unpacked_bytes} bytes)",
                    name,
                    "max_unpacked_bytes",
                )
        elif not member.isdir():
            raise PackageRefused(
                f"a {_kind(member)}: only regular files, directories and links are allowed",
                name,
                "type",
            )
        self.paths.append(path)

    def check_links(self) -> None:
        """With every link known: no link leads out of the tree, and nothing is written
        through a link (a file under a linked directory lands wherever the link points)."""
        for path, target in sorted(self.symlinks.items()):
            joined = posixpath.join(posixpath.dirname(path), target)
            if _resolve(joined, self.symlinks) is None:
                raise PackageRefused(f"a link to {target!r}, outside the package", path, "link")
        for path, target in sorted(self.hardlinks.items()):
            if _resolve(target, self.symlinks) is None or _has_dotdot(target):
                raise PackageRefused(f"a link to {target!r}, outside the package", path, "link")
        for path in self.paths:
            parts = path.split("/")
            for i in range(1, len(parts)):
                parent = "/".join(parts[:i])
                if parent in self.symlinks:
                    message = f"its path passes through the link {parent!r}"
                    raise PackageRefused(message, path, "link")


def _relative_path(name: str, what: str) -> str:
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise PackageRefused(f"an absolute {what}", name, "absolute")
    if "\\" in name or "\x00" in name:
        raise PackageRefused(f"a {what} with a backslash or NUL", name, "path")
    if _has_dotdot(name):
        raise PackageRefused(f"a '..' component in its {what}", name, "dotdot")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts:
        raise PackageRefused(f"an empty {what}", name, "path")
    return "/".join(parts)


def _is_root(name: str) -> bool:
    return not name.startswith("/") and all(p in ("", ".") for p in name.split("/"))


def _has_dotdot(name: str) -> bool:
    return ".." in name.split("/")


def _resolve(path: str, links: dict[str, str]) -> str | None:
    """Where ``path`` (relative to the package's root) leads once the package's links are
    followed, as a relative path; None when it leaves the package (or loops)."""
    pending = [p for p in path.split("/") if p not in ("", ".")]
    done: list[str] = []
    hops = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if not done:
                return None
            done.pop()
            continue
        here = "/".join([*done, part])
        if here in links:
            hops += 1
            target = links[here]
            if hops > MAX_LINK_HOPS or target.startswith("/"):
                return None
            pending = [p for p in target.split("/") if p not in ("", ".")] + pending
            continue
        done.append(part)
    return "/".join(done)


def _kind(member: tarfile.TarInfo) -> str:
    if member.ischr():
        return "character device"
    if member.isblk():
        return "block device"
    if member.isfifo():
        return "FIFO"
    return f"entry of tar type {member.type!r}"
