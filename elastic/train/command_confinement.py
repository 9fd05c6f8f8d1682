"""What a command job's process may reach: the rules ``confine.py`` enforces (Landlock's
reads and writes), and the uid it runs as."""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elastic.checkpoint.storage import is_object_uri
from elastic.train import command_env

# What a command may read of /etc: what the C library, Python, TLS and name lookups read;
# not the rest (shadow files, the host's keys and service configuration).
ETC_READABLE = (
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "timezone",
    "passwd",
    "group",
    "nsswitch.conf",
    "host.conf",
    "hosts",
    "resolv.conf",
    "gai.conf",
    "services",
    "protocols",
    "mime.types",
    "ssl",
    "ca-certificates",
    "pki",
    "os-release",
    "debian_version",
    "lsb-release",
    "redhat-release",
    "system-release",
    "alpine-release",
    "machine-id",
    "locale.alias",
    "alternatives",
)


def reachable_by_others(path: str) -> bool:
    """Whether a uid that neither owns nor shares a group with ``path`` and its folders
    can pass through them and read and run it."""
    real = Path(os.path.realpath(path))
    if real.stat().st_mode & 0o005 != 0o005:
        return False
    return all(folder.stat().st_mode & 0o001 for folder in real.parents)


def unprivileged_uid(owner: str) -> int | None:
    """The uid a root worker runs an owner's command as; None when the worker is not root
    (the command runs as the worker's uid), or when the workers' Python lies where other
    uids cannot reach it (under ``/root``, for one): then it runs as uid 0, with no
    capabilities and within Landlock's bounds, which the job's log says."""
    if os.geteuid() != 0:
        return None
    if not reachable_by_others(sys.executable):
        print(
            f"[elastic-train] the command runs as uid 0 without capabilities, not as an "
            f"unprivileged uid: this node's Python ({os.path.realpath(sys.executable)}) "
            "cannot be run by other users",
            file=sys.stderr,
            flush=True,
        )
        return None
    return command_env.uid_of(owner)


def readable_roots() -> list[str]:
    """What a command may read besides its own directories: the system's programs and
    libraries, Python's installation (this interpreter's, its packages'), ``elastic_train``'s
    package (``elastic_train.report``) and ``elastic``'s (what runs a package's
    ``train_loop`` in the child)."""
    # Found, not imported: the client package is not the workers' to load.
    client = importlib.util.find_spec("elastic_train")
    roots = {"/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/proc", "/sys"}
    roots |= {f"/etc/{name}" for name in ETC_READABLE}
    roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
    roots |= {p for p in sysconfig.get_paths().values() if p}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    if client is not None and client.origin:
        roots.add(str(Path(client.origin).parent))
    roots.add(str(Path(__file__).resolve().parents[1]))
    roots.add(str(Path(os.path.realpath(sys.executable)).parent))
    return sorted(r for r in roots if os.path.exists(r))


def confinement(
    workdir: Path, files: str | None, uid: int | None, data_roots: Sequence[str] = ()
) -> dict[str, Any]:
    """``confine.py``'s rules for a command: it writes its working directory, its job's
    own directory and devices (``/dev/shm`` for DataLoader workers), reads what
    :func:`readable_roots` names and its owner's ``data_roots``, and runs as ``uid``."""
    writable = [str(workdir), "/dev", *([files] if files and not is_object_uri(files) else [])]
    readable = [*readable_roots(), *data_roots]
    return {"read": readable, "write": writable, "uid": uid, "gid": uid}


def writing_checkpoints(
    rules: dict[str, Any], checkpoint_dir: str, uid: int | None
) -> dict[str, Any]:
    """``rules`` for a package loop's child, which also writes the job's checkpoint
    directory (its context saves there): made on first use, and its uid's."""
    if is_object_uri(checkpoint_dir):
        return rules
    Path(checkpoint_dir).mkdir(parents=True, exist_ok=True)
    if uid is not None:
        os.chown(checkpoint_dir, uid, uid)
    return {**rules, "write": [*rules["write"], checkpoint_dir]}
