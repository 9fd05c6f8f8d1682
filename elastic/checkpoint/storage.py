"""Where checkpoints are kept, behind one small interface.

A checkpoint is a named set of parts (files) plus a manifest. The manifest is written
last and is the commit marker: a checkpoint without one does not exist. The local
filesystem stages the parts in a temporary directory and renames it into place; an object
store (``s3://``, ``gs://``, ``abfs://`` through ``pyarrow.fs``, which has no rename) stages
them on local disk, uploads them under the name and puts the manifest last, so the same
retention and verification code runs over both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol

log = logging.getLogger(__name__)

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

    def present(self, name: str) -> bool:
        """Whether anything of checkpoint ``name`` is there, a corrupt one's parts too."""
        ...

    def part_digest(self, name: str, part: str) -> tuple[int, str] | None:
        """(size, SHA-256) of one part, or None when it is missing."""
        ...

    def open_part(self, name: str, part: str) -> IO[bytes]:
        """One part (or the manifest) opened for reading from its start, for a reader that
        streams it rather than holding it whole; FileNotFoundError when it is missing."""
        ...

    def part_stamp(self, name: str, part: str) -> tuple[int, int] | None:
        """A cheap fingerprint of one part (size, modification time), None when missing:
        a part whose stamp is unchanged since it was hashed need not be hashed again."""
        ...

    def location(self, name: str) -> str:
        """Where the checkpoint is, as events and the API show it (a path or a URI)."""
        ...

    def local_copy(self, name: str) -> Path:
        """A local directory holding the checkpoint's parts (for readers that need files):
        the checkpoint itself on a filesystem, a fresh download from an object store."""
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
    return int(rc) == 0


class LocalCheckpointStorage:
    """Checkpoints as directories under ``root`` on a filesystem every node mounts."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def present(self, name: str) -> bool:
        return (self.root / name).is_dir()

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

    def open_part(self, name: str, part: str) -> IO[bytes]:
        return (self.root / name / part).open("rb")

    def part_stamp(self, name: str, part: str) -> tuple[int, int] | None:
        try:
            st = (self.root / name / part).stat()
        except OSError:
            return None
        return st.st_size, st.st_mtime_ns

    def location(self, name: str) -> str:
        return str(self.root / name)

    def local_copy(self, name: str) -> Path:
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


OBJECT_SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs")
ORPHAN_PREFIX = "step_"


def is_object_uri(root: str) -> bool:
    """Whether ``root`` names an object store (``s3://bucket/prefix``) rather than a path."""
    scheme, sep, _ = root.partition("://")
    return bool(sep) and scheme.lower() in OBJECT_SCHEMES


def storage_for(root: str | os.PathLike[str]) -> CheckpointStorage:
    """The storage a checkpoint root names: an object store for a URI, else a directory."""
    text = os.fspath(root)
    if is_object_uri(text):
        return ObjectCheckpointStorage(text)
    return LocalCheckpointStorage(text)


def local_side_dir(uri: str) -> Path:
    """This node's directory for one store location's local files (staging, side files)."""
    key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "etrain-staging" / key


def join_location(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def split_location(location: str) -> tuple[str, str]:
    """(the checkpoints' root, the checkpoint's name) of a path or URI."""
    parent, _, name = location.rstrip("/").rpartition("/")
    return parent, name


class ObjectCheckpointStorage:
    """Checkpoints as prefixes of an object store, through ``pyarrow.fs`` (what Ray Train
    uses). Credentials and endpoint come from the store's standard variables
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ...).

    There is no rename: the parts are uploaded first and the manifest last, and the manifest
    is the only thing that makes a checkpoint exist. A prefix ``step_*`` without one is what
    a writer that died mid-upload left, removed by :meth:`clean_staging`. Saving a step that
    exists deletes its manifest first, so a reader in between sees the previous checkpoint,
    never old sums over new parts."""

    def __init__(self, uri: str) -> None:
        from pyarrow import fs as pafs

        self.uri = uri.rstrip("/")
        self.fs, path = pafs.FileSystem.from_uri(self.uri)
        self.base = path.rstrip("/")
        # Local staging shared by the ranks of one node that pass the same tag.
        self.staging_root = local_side_dir(self.uri) / "staging"

    def _key(self, *parts: str) -> str:
        return "/".join((self.base, *parts))

    def _list(self, prefix: str, recursive: bool = False) -> list[Any]:
        from pyarrow import fs as pafs

        selector = pafs.FileSelector(prefix, recursive=recursive, allow_not_found=True)
        return list(self.fs.get_file_info(selector))

    def _top_level(self) -> list[str]:
        from pyarrow import fs as pafs

        return [
            info.base_name
            for info in self._list(self.base)
            if info.type == pafs.FileType.Directory and not info.base_name.startswith(".")
        ]

    def _exists(self, key: str) -> bool:
        from pyarrow import fs as pafs

        return bool(self.fs.get_file_info(key).type == pafs.FileType.File)

    def names(self) -> list[str]:
        return [n for n in self._top_level() if self._exists(self._key(n, MANIFEST))]

    def present(self, name: str) -> bool:
        return name in self._top_level()

    def read_manifest(self, name: str) -> dict[str, Any] | None:
        try:
            with self.fs.open_input_stream(self._key(name, MANIFEST)) as fh:
                data = json.loads(fh.read())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def part_digest(self, name: str, part: str) -> tuple[int, str] | None:
        digest = hashlib.sha256()
        size = 0
        try:
            with self.fs.open_input_stream(self._key(name, part)) as fh:
                while block := fh.read(1 << 20):
                    digest.update(block)
                    size += len(block)
        except (FileNotFoundError, OSError):
            return None
        return size, digest.hexdigest()

    def open_part(self, name: str, part: str) -> IO[bytes]:
        # pyarrow's NativeFile is a binary file object (read, close, context manager).
        stream: IO[bytes] = self.fs.open_input_stream(self._key(name, part))
        return stream

    def part_stamp(self, name: str, part: str) -> tuple[int, int] | None:
        from pyarrow import fs as pafs

        info = self.fs.get_file_info(self._key(name, part))
        if info.type != pafs.FileType.File:
            return None
        return int(info.size or 0), int(info.mtime_ns or 0)

    def location(self, name: str) -> str:
        return join_location(self.uri, name)

    def local_copy(self, name: str) -> Path:
        from pyarrow import fs as pafs

        target = Path(tempfile.mkdtemp(prefix=f"etrain-restore-{name}-"))
        prefix = self._key(name)
        for info in self._list(prefix, recursive=True):
            if info.type != pafs.FileType.File:
                continue
            local = target / info.path[len(prefix) + 1 :]
            local.parent.mkdir(parents=True, exist_ok=True)
            pafs.copy_files(info.path, str(local), source_filesystem=self.fs)
        return target

    @contextmanager
    def staging(self, name: str, tag: str) -> Iterator[Path]:
        path = self.staging_root / f"{name}-{tag}"
        path.mkdir(parents=True, exist_ok=True)
        try:
            yield path
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise

    def commit(self, staged: Path, name: str, manifest: dict[str, Any]) -> None:
        from pyarrow import fs as pafs

        manifest_key = self._key(name, MANIFEST)
        if self._exists(manifest_key):
            # The same step saved again: it stops existing before its parts change.
            self.fs.delete_file(manifest_key)
        self.remove(name)
        self.fs.create_dir(self._key(name))
        for f in sorted(p for p in staged.rglob("*") if p.is_file() and p.name != MANIFEST):
            key = self._key(name, str(f.relative_to(staged)))
            pafs.copy_files(str(f), key, destination_filesystem=self.fs)
        with self.fs.open_output_stream(manifest_key) as fh:
            fh.write(json.dumps(manifest, indent=1).encode())
        shutil.rmtree(staged, ignore_errors=True)  # uploaded: the local copy is no checkpoint

    def remove(self, name: str) -> None:
        from pyarrow import fs as pafs

        if self.fs.get_file_info(self._key(name)).type != pafs.FileType.NotFound:
            self.fs.delete_dir(self._key(name))

    def move_aside(self, name: str) -> str:
        from pyarrow import fs as pafs

        aside = f"{CORRUPT_DIR}/{name}-{uuid.uuid4().hex[:8]}"
        prefix = self._key(name)
        if not self._exists(self._key(name, MANIFEST)):
            raise FileNotFoundError(self.location(name))
        self.fs.create_dir(self._key(aside))
        for info in self._list(prefix, recursive=True):
            if info.type == pafs.FileType.File:
                self.fs.copy_file(info.path, self._key(aside, info.path[len(prefix) + 1 :]))
        # The manifest goes first: from then on the checkpoint does not exist.
        self.fs.delete_file(self._key(name, MANIFEST))
        self.remove(name)
        return self.location(aside)

    def clean_staging(self) -> list[str]:
        shutil.rmtree(self.staging_root, ignore_errors=True)
        removed = []
        for name in self._top_level():
            if name.startswith(ORPHAN_PREFIX) and not self._exists(self._key(name, MANIFEST)):
                self.remove(name)
                removed.append(name)
        return sorted(removed)


# -- is a checkpoint directory shared by every node? -------------------------------------------

PROBE_PREFIX = ".etrain-probe-"
# The setting a user changes when the probe fails; named in the job's failure reason.
CHECKPOINT_SETTING = "ETRAIN_CHECKPOINT_DIR (the chart's checkpoints values)"
PROBE_TIMEOUT_S = 20.0


def probe_from_node(root: str, name: str, token: str, answer: str) -> tuple[str, str | None]:
    """Run on a worker node: read the supervisor's probe file and leave an answer beside it.
    Returns this node's address and what went wrong (None: both directions work)."""
    import ray

    node = f"{ray.util.get_node_ip_address()} (id {ray.get_runtime_context().get_node_id()[:12]})"
    sent = Path(root) / f"{name}.sent"
    try:
        seen = sent.read_text()
    except OSError as e:
        return node, f"cannot read a file the supervisor wrote there ({e.strerror})"
    if seen != token:
        return node, "reads a different file under the same name (a node-local directory)"
    try:
        (Path(root) / answer).write_text(token)
    except OSError as e:
        return node, f"cannot write there ({e.strerror})"
    return node, None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


class SharingBook(Protocol):
    """Which nodes already showed that they share a checkpoint directory (kept cluster-wide
    by the membership watcher): a node that answered once is not probed again for it."""

    async def nodes_sharing(self, root: str) -> frozenset[str]: ...

    async def record_sharing(self, root: str, nodes: list[str]) -> None: ...


async def unshared_checkpoint_dir(
    root: str,
    per_worker: dict[str, float],
    timeout_s: float = PROBE_TIMEOUT_S,
    book: SharingBook | None = None,
) -> str | None:
    """Whether the supervisor and every node that can hold a worker see the same ``root``:
    the supervisor writes a probe file, one zero-CPU task per other node reads it and writes
    an answer, the supervisor reads the answers. A directory on each node's own disk would
    otherwise fail silently: the supervisor sees no checkpoint and a restart begins at step
    0. Returns the reason the job cannot run there, or None. A bucket is the same for every
    node and is not probed; a node that does not answer in time is not held against it.

    With a ``book``, the nodes that already answered for ``root``'s parent (the service's
    checkpoint directory, which holds every job's: what a node mounts) are not asked again,
    by their Ray node ids (a node that restarts is a new node), and those that answer now
    are recorded: each probe task starts a worker process on its node (about a second before
    the job's first attempt can start, and most of a core-second per node), which every
    job start on a shared directory paid before. A directory that a node stops sharing
    while it stays up (a mount removed by hand) goes unnoticed until that node restarts."""
    if is_object_uri(root):
        return None
    import asyncio

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    own = ray.get_runtime_context().get_node_id()
    nodes = [
        n
        for n in ray.nodes()
        if n["Alive"]
        and n["NodeID"] != own
        and all(n["Resources"].get(k, 0.0) >= v for k, v in per_worker.items() if v > 0)
    ]
    mount = os.path.dirname(os.path.normpath(root))
    if book is not None and nodes:
        try:
            known = await book.nodes_sharing(mount)
        except Exception:  # the book is a shortcut: without it, every node is asked
            log.warning("the checkpoint directory's sharing book is unreachable", exc_info=True)
            known = frozenset()
        nodes = [n for n in nodes if n["NodeID"] not in known]
    if not nodes:
        return None
    path = Path(root)
    name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    token = uuid.uuid4().hex
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}.sent").write_text(token)
    except OSError as e:
        return f"the supervisor cannot write to the checkpoint directory {root} ({e.strerror})"
    task = ray.remote(num_cpus=0, max_retries=0)(probe_from_node)
    refs = [
        task.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(root, name, token, f"{name}.answer-{i}")
        for i, n in enumerate(nodes)
    ]
    sharing: list[str] = []
    try:
        futures = [asyncio.ensure_future(r) for r in refs]
        await asyncio.wait(futures, timeout=timeout_s)
        problems: list[str] = []
        for i, future in enumerate(futures):
            if not future.done() or future.exception() is not None:
                future.cancel()
                continue  # slow, or the node died under the probe: not the directory's fault
            node, problem = future.result()
            if problem is None and _read(path / f"{name}.answer-{i}") != token:
                problem = "writes a file the supervisor cannot read"
            if problem is not None:
                problems.append(f"node {node} {problem}")
            else:
                sharing.append(nodes[i]["NodeID"])
    finally:
        for leftover in path.glob(f"{name}.*"):
            leftover.unlink(missing_ok=True)
    if book is not None and sharing:
        try:
            await book.record_sharing(mount, sharing)
        except Exception:
            log.warning("the checkpoint directory's sharing book is unreachable", exc_info=True)
    if not problems:
        return None
    return (
        f"the checkpoint directory {root} is not shared by every Ray node: "
        + "; ".join(sorted(problems))
        + f". Set {CHECKPOINT_SETTING} to a directory every node mounts at the same path, "
        "or to a bucket (s3://bucket/prefix)"
    )
