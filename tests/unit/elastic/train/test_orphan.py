"""A replica whose raylet died ends at once (elastic/train/orphan.py): real processes,
the parent SIGKILLed as a raylet is when its node fails."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(60)
"""

CHILD = """
import os, sys, time
from elastic.train.orphan import die_with_parent
name = os.path.basename(sys.executable).encode()
watching = die_with_parent(parent_name=name)
print("watching" if watching else "not watching", file=sys.stderr, flush=True)
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie is dead, waiting for init to reap it


def _start(tmp_path: Path, child: str) -> tuple[subprocess.Popen[str], int, str]:
    """(the parent, its child's pid, what the child said of its watch)"""
    out = tmp_path / "child.out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[4])}
    with out.open("w") as child_out:
        parent = subprocess.Popen(
            [sys.executable, "-c", PARENT, child],
            stdout=subprocess.PIPE,
            stderr=child_out,
            text=True,
            env=env,
        )
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 30  # its imports
    while "watching" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return parent, pid, out.read_text().strip().splitlines()[-1]


def test_a_process_ends_within_a_poll_of_its_parents_death(tmp_path: Path) -> None:
    parent, child, said = _start(tmp_path, CHILD)
    try:
        assert said == "watching" and not _gone(child)
        killed = time.monotonic()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        while not _gone(child) and time.monotonic() - killed < 5:
            time.sleep(0.01)
        took = time.monotonic() - killed
        assert _gone(child), "the orphan lived on"
        assert took < 0.5, took  # Ray's own check: up to a second
    finally:
        for pid in (parent.pid, child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_no_watch_when_the_parent_is_not_the_one_named(tmp_path: Path) -> None:
    child = CHILD.replace("parent_name=name", 'parent_name=b"raylet"')
    parent, pid, said = _start(tmp_path, child)
    try:
        assert said == "not watching"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        time.sleep(0.5)
        assert not _gone(pid)  # nothing watched: it lives on, as any orphan does
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
