"""``confine.py`` run as the worker runs it, with the real kernel: Landlock's bounds, no
capabilities, the command's status, and SIGTERM passed on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic.train import command_confinement, command_process

LANDLOCK = subprocess.run(
    [sys.executable, "-c", "import ctypes; print(ctypes.CDLL(None).syscall(444, None, 0, 1))"],
    capture_output=True,
    text=True,
).stdout.strip()
needs_landlock = pytest.mark.skipif(
    not LANDLOCK.isdigit() or int(LANDLOCK) < 1, reason="this kernel has no Landlock"
)


def confined(tmp_path: Path, code: str, **popen: object) -> subprocess.Popen[str]:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    rules = command_confinement.confinement(work, None, None)
    argv = [sys.executable, "-I", str(command_process.CONFINE), json.dumps(rules), "--"]
    return subprocess.Popen(
        [*argv, sys.executable, "-c", code],
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,  # type: ignore[call-overload]
    )


@needs_landlock
def test_a_confined_command_reads_and_writes_only_within_its_bounds(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("not yours")
    code = f"""
import os, pathlib
def attempt(f):
    try:
        f()
        return "ok"
    except OSError as e:
        return type(e).__name__
print(attempt(lambda: pathlib.Path({str(outside)!r}).read_text()))
print(attempt(lambda: pathlib.Path({str(tmp_path / "planted")!r}).write_text("x")))
print(attempt(lambda: pathlib.Path("mine").write_text("x")))
print(attempt(lambda: pathlib.Path("/etc/hostname").read_text()))
print(attempt(lambda: pathlib.Path("/etc/passwd").read_text()))
import torch
print(torch.ones(2).sum().item())
"""
    process = confined(tmp_path, code)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert out.split() == [
        "PermissionError",
        "PermissionError",
        "ok",
        "PermissionError",
        "ok",
        "2.0",
    ]
    assert not (tmp_path / "planted").exists()
    assert (tmp_path / "work" / "mine").read_text() == "x"


def test_the_command_s_status_is_the_confiner_s(tmp_path: Path) -> None:
    process = confined(tmp_path, "import sys; sys.exit(3)")
    process.communicate(timeout=60)
    assert process.returncode == 3
    process = confined(tmp_path, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGKILL


def test_sigterm_reaches_the_command_which_may_save_first(tmp_path: Path) -> None:
    code = """
import pathlib, signal, sys, time
def save(*_):
    pathlib.Path("saved").write_text("at sigterm")
    sys.exit(0)
signal.signal(signal.SIGTERM, save)
print("ready", flush=True)
time.sleep(60)
"""
    process = confined(tmp_path, code, start_new_session=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=30)
    assert process.returncode == 0
    assert time.monotonic() - started < 10
    assert (tmp_path / "work" / "saved").read_text() == "at sigterm"


def test_as_root_the_command_has_no_capability(tmp_path: Path) -> None:
    code = """
import pathlib
status = pathlib.Path("/proc/self/status").read_text().splitlines()
print(*[line.split()[1] for line in status if line.startswith(("CapEff", "CapPrm", "CapBnd"))])
"""
    process = confined(tmp_path, code)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert out.split() == ["0000000000000000"] * 3
