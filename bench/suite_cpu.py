"""Where a command's CPU goes on this machine: the whole machine's CPU-seconds over the run
(from ``/proc/stat``), the least wall time that work could take on the machine's cores, and
the CPU-seconds of every process, grouped by kind (a Ray actor by its class, a Python
process by its script), sampled from ``/proc`` every ``--interval`` seconds.

It was written to answer one question about the test suite: could a better layout bring it
under 15 minutes on 2 cores? If the suite's CPU work divided by the cores is more than 15
minutes, no layout can. It also times, in fresh processes, what every training process of
a job imports before its first step (torch, ``torch._dynamo``, which torch's optimizers and
DDP import on first use, the training loop), so the table shows what starting a process
per job and per worker costs.

    .venv/bin/python -m bench.suite_cpu                 # pytest as `make test` runs it
    .venv/bin/python -m bench.suite_cpu -- COMMAND ...  # any other command
    PYTEST_WRAP=".venv/bin/python -m bench.suite_cpu --" .ci/run   # CI's whole run

A process seen before the command started counts only the CPU it used during the run. A
process that lived less than one interval may be missed, and each one's last interval is
lost: the per-kind figures are lower bounds; the machine's total is exact. The sampler
itself is listed (``python:-m bench.suite_cpu``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
PF_KTHREAD = 0x00200000  # a kernel thread's flag in /proc/PID/stat
SUITE = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-ra", "--durations=40"]
# What a training process (restart mode's WarmWorker, in place's Replica) imports before its
# first step: torch's optimizers import torch._dynamo on their first use.
TRAINING_IMPORTS = (
    "import ray, torch, torch._dynamo, elastic.train.context, elastic.in_place.context, "
    "jobs.workloads.image_classification"
)
TRAINING_KINDS = frozenset({"ray::WarmWorker", "ray::Replica"})


def process_kind(argv: list[str]) -> str:
    """A stable name for what a process is: a Ray worker by its actor class or task (its
    title is ``ray::Class`` or ``ray::Class.method`` while a call runs), a Python process by
    its script or module, anything else by its program."""
    if not argv or not argv[0]:
        return "kernel"
    first = argv[0]
    if first.startswith("ray::"):
        return first.split()[0].split(".")[0]
    program = os.path.basename(first.split()[0])
    if program.startswith("python") and len(argv) > 1:
        rest = [a for a in argv[1:] if not a.startswith("-") or a in ("-m", "-c")]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return f"python:-m {rest[1]}"
        if rest[:1] == ["-c"] and len(rest) > 1:  # pytest-xdist's workers, multiprocessing's
            return f"python:-c {rest[1][:24]}"
        return f"python:{os.path.basename(rest[0])}" if rest else program
    return program


@dataclass
class Seen:
    kind: str
    cpu_at_first_sight: float
    cpu: float
    before: bool  # alive when the run began: only its growth counts


@dataclass(frozen=True)
class KindTotal:
    kind: str
    processes: int
    cpu_s: float


def totals(seen: Iterable[Seen]) -> list[KindTotal]:
    """CPU-seconds per kind, the largest first."""
    by_kind: dict[str, tuple[int, float]] = {}
    for s in seen:
        count, cpu = by_kind.get(s.kind, (0, 0.0))
        used = s.cpu - s.cpu_at_first_sight if s.before else s.cpu
        by_kind[s.kind] = (count + 1, cpu + used)
    return sorted(
        (KindTotal(kind, n, cpu) for kind, (n, cpu) in by_kind.items()), key=lambda t: -t.cpu_s
    )


def machine_busy_s() -> float:
    """Busy CPU-seconds of the whole machine since boot, every core's."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return (sum(fields[:8]) - idle) / TICKS


def read_process(pid: str) -> tuple[tuple[str, str], float, list[str] | None] | None:
    """(pid, start time), CPU-seconds so far, and its command line: None while it is a
    zombie (which reads as an empty one: it keeps the kind it had)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    # Fields of stat from the state on: state 0, flags 6, utime 11, stime 12, starttime 19.
    cpu = (int(fields[11]) + int(fields[12])) / TICKS
    argv: list[str] | None = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    if not argv and not int(fields[6]) & PF_KTHREAD:
        argv = None  # exited, not yet reaped
    return (pid, fields[19]), cpu, argv


class Sampler:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.seen: dict[tuple[str, str], Seen] = {}
        self.done = threading.Event()
        self.first = True

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            read = read_process(pid)
            if read is None:
                continue
            key, cpu, argv = read
            kind = process_kind(argv) if argv is not None else None
            entry = self.seen.get(key)
            if entry is None:
                self.seen[key] = Seen(kind or "exited", cpu, cpu, before=self.first)
                continue
            entry.cpu = cpu
            # A Ray worker's title names its actor once it has one, and keeps it while idle.
            if kind is not None and kind != "ray::IDLE":
                entry.kind = kind
        self.first = False

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.interval_s)
        self.sample()


def import_cpu_s(runs: int) -> list[float]:
    """CPU-seconds (user and system) of a fresh Python importing what a training process
    imports, once per run."""
    times = []
    for _ in range(runs):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([sys.executable, "-c", TRAINING_IMPORTS], check=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        times.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--import-runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("command", nargs="*", help="after --; the suite by default")
    args = parser.parse_args()
    command = args.command or SUITE
    cores = os.cpu_count() or 1

    imports = import_cpu_s(args.import_runs)
    sampler = Sampler(args.interval)
    thread = threading.Thread(target=sampler.run, daemon=True)
    busy0 = machine_busy_s()
    started = time.monotonic()
    thread.start()
    rc = subprocess.run(command).returncode
    wall = time.monotonic() - started
    busy1 = machine_busy_s()
    sampler.done.set()
    thread.join()

    busy = busy1 - busy0
    floor = busy / cores
    kinds = totals(sampler.seen.values())
    training = sum(t.processes for t in kinds if t.kind in TRAINING_KINDS)
    per_start = statistics.median(imports)
    print()
    print(f"command: {' '.join(command)} (exit {rc})")
    print(f"wall {wall:.0f} s; the machine's CPU over it {busy:.0f} CPU-s on {cores} cores")
    print(f"busy {busy / (wall * cores):.1%}; the least wall time for that work: {floor:.0f} s")
    print(
        f"a training process's imports: {per_start:.2f} CPU-s "
        f"(median of {len(imports)}, {min(imports):.2f}-{max(imports):.2f}); "
        f"{training} training processes started: {training * per_start:.0f} CPU-s, "
        f"{training * per_start / busy:.0%} of the run"
    )
    print()
    print(f"| {'kind':<36} | processes | CPU-s | share |")
    print(f"|{'-' * 38}|-----------|-------|-------|")
    for t in kinds[: args.top]:
        print(f"| {t.kind:<36} | {t.processes:>9} | {t.cpu_s:>5.0f} | {t.cpu_s / busy:>5.1%} |")
    sys.exit(rc)


if __name__ == "__main__":
    main()
