"""Runs a user's command confined, as the first process of its own world.

``python -I confine.py RULES -- ARGV...``, where RULES is JSON:
``{"read": [paths], "write": [paths], "uid": int | null, "gid": int | null,
"cgroups": [paths]}``.

It is run by path with ``-I`` and imports the standard library only, so that nothing the
user's package or environment holds is imported into it. It:

- moves itself into the control groups the worker made for the command (``cgroups``: their
  ``cgroup.procs`` files), which hold it and every process it starts to the job's CPUs and
  memory (``command_limits.py``), while it may still write them;
- restricts what the command can touch with Landlock (when the kernel has it): it reads
  and executes beneath ``read`` and ``write``, writes beneath ``write`` only. Landlock's
  rules hold for every process the command starts, and for root too;
- starts ARGV as ``uid``/``gid`` with no supplementary groups (when given: the caller
  is root), and with no capabilities (uid 0 too), and waits for it;
- passes SIGTERM and SIGINT on to every process of the command: run as the first process
  of a new PID namespace (``unshare --pid --fork --kill-child``), it signals the whole
  namespace, and when it exits the kernel kills whatever the command left running;
- exits with the command's status (128 + the signal's number when a signal ended it).

Refusals it cannot enforce (no Landlock) are said on stderr, once, and the command runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from typing import Any

# Landlock's syscalls (the same numbers on every architecture Linux gives them to).
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_RULE_PATH_BENEATH = 1
_CREATE_RULESET_VERSION = 1
_PR_SET_NO_NEW_PRIVS = 38

_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1, 2, 4, 8
# REMOVE_DIR .. MAKE_SYM (ABI 1), REFER (2), TRUNCATE (3), IOCTL_DEV (5)
_CHANGE_TREE = 16 | 32 | 64 | 128 | 256 | 512 | 1024 | 2048 | 4096
_REFER, _TRUNCATE, _IOCTL_DEV = 8192, 16384, 32768
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1, 2
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_LAST_CAP = 63


def _handled(abi: int) -> int:
    rights = _EXECUTE | _WRITE_FILE | _READ_FILE | _READ_DIR | _CHANGE_TREE
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    if abi >= 5:
        rights |= _IOCTL_DEV
    return rights


def landlock(read: list[str], write: list[str]) -> str | None:
    """Confine this process and its future children; returns why not, or None when done.
    From Landlock's ABI 6 they also cannot signal, nor reach the abstract Unix sockets of,
    processes outside it (the worker, Ray's processes), whatever their uid."""
    libc = ctypes.CDLL(None, use_errno=True)
    syscall = libc.syscall
    syscall.restype = ctypes.c_long
    abi = syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return f"this kernel has no Landlock ({os.strerror(ctypes.get_errno())})"
    handled = _handled(abi)
    # struct landlock_ruleset_attr: handled_access_fs, handled_access_net (ABI 4), scoped (6).
    scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL if abi >= 6 else 0
    fields = [handled, 0, scoped] if scoped else [handled]
    attr = (ctypes.c_uint64 * len(fields))(*fields)
    size = ctypes.c_size_t(ctypes.sizeof(attr))
    fd = syscall(_CREATE_RULESET, ctypes.byref(attr), size, ctypes.c_uint32(0))
    if fd < 0:
        return f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"
    reading = _EXECUTE | _READ_FILE | _READ_DIR
    try:
        for paths, rights in ((read, reading), (write, handled)):
            for path in paths:
                try:
                    parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
                except OSError:
                    continue  # not on this node: nothing to allow
                allowed = rights if os.path.isdir(path) else rights & _FILE_RIGHTS
                # struct landlock_path_beneath_attr is packed: u64 rights, s32 fd.
                rule = allowed.to_bytes(8, sys.byteorder) + parent.to_bytes(4, sys.byteorder)
                buffer = ctypes.create_string_buffer(rule, len(rule))
                done = syscall(_ADD_RULE, fd, _RULE_PATH_BENEATH, buffer, ctypes.c_uint32(0))
                os.close(parent)
                if done != 0:
                    return f"landlock_add_rule {path}: {os.strerror(ctypes.get_errno())}"
        if syscall(_RESTRICT_SELF, fd, ctypes.c_uint32(0)) != 0:
            return f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}"
    finally:
        os.close(fd)
    return None


def drop_capabilities() -> None:
    """What this process starts from now on has no capability, even as uid 0: with the
    bounding and ambient sets empty, exec gives root none (capabilities(7))."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in range(_LAST_CAP + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # past the kernel's last: EINVAL


def join_groups(procs_files: list[str]) -> None:
    """This process into each group (``0``: the writer), before Landlock would refuse it."""
    for procs in procs_files:
        try:
            with open(procs, "w") as f:
                f.write("0")
        except OSError as e:
            print(
                f"[elastic-train] the command is not held to its limits: {procs}: {e.strerror}",
                file=sys.stderr,
                flush=True,
            )


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: confine.py RULES -- ARGV...", file=sys.stderr)
        return 2
    rules: dict[str, Any] = json.loads(argv[0])
    command = argv[2:]
    join_groups(list(rules.get("cgroups") or []))
    # No program it runs gains privileges (setuid, file capabilities); Landlock needs it too.
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        print(f"[elastic-train] no_new_privs: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
    why_not = landlock(list(rules.get("read") or []), list(rules.get("write") or []))
    if why_not:
        print(f"[elastic-train] files are not confined: {why_not}", file=sys.stderr, flush=True)
    uid, gid = rules.get("uid"), rules.get("gid")
    if os.geteuid() == 0:
        drop_capabilities()
    first_of_namespace = os.getpid() == 1
    try:
        child = subprocess.Popen(
            command,
            user=uid,
            group=gid,
            extra_groups=[] if uid is not None else None,
            # Outside a namespace of its own, the command's processes are one group to end.
            start_new_session=not first_of_namespace,
            # elastic_train.report's pipe to the worker, and the worker's answers to a loop.
            pass_fds=[
                int(fd)
                for fd in [os.environ.get("ETRAIN_REPORT_FD"), os.environ.get("ETRAIN_REPLY_FD")]
                if fd
            ],
        )
    except OSError as e:
        print(f"[elastic-train] cannot run {command[0]!r}: {e}", file=sys.stderr, flush=True)
        return 127

    def pass_on(signum: int, _frame: Any) -> None:
        # -1 from the namespace's first process: every other process of the namespace.
        target = -1 if first_of_namespace else -child.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
