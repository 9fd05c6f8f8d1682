"""What the tests read of this machine's processes in ``/proc``."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def process_tree(root_pid: int) -> set[int]:
    """``root_pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo.extend(children.get(pid, []))
    return tree


def named(pids: Iterable[int], prefix: bytes) -> set[int]:
    """Those of ``pids`` whose command line (a Ray worker's title) starts with ``prefix``."""
    found = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(prefix):
                found.add(pid)
        except OSError:
            continue
    return found


def ready_to_train(pids: Iterable[int]) -> set[int]:
    """Those of ``pids`` that wait in a node's pool (elastic/warm_processes.py): idle Ray
    worker processes started to train that have imported torch."""
    found = set()
    for pid in named(pids, b"ray::IDLE"):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            training = b"ELASTIC_TRAIN_PRELOAD=training\0" in environ
            if training and "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text():
                found.add(pid)
        except OSError:
            continue
    return found
