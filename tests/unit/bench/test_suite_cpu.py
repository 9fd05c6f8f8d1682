"""The CPU accounting of bench/suite_cpu.py: what each process counts as, and the totals."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.suite_cpu import Sampler, Seen, process_kind, totals


def test_processes_are_named_by_actor_script_or_program() -> None:
    assert process_kind(["ray::WarmWorker.run"]) == "ray::WarmWorker"
    assert process_kind(["ray::Replica", ""]) == "ray::Replica"
    assert process_kind(["ray::IDLE"]) == "ray::IDLE"
    assert process_kind(["/work/.venv/bin/python3", "-m", "pytest", "-n", "2"]) == (
        "python:-m pytest"
    )
    assert process_kind(["/usr/bin/python3.11", "-u", "/x/ray/dashboard/agent.py"]) == (
        "python:agent.py"
    )
    assert process_kind(["/x/ray/core/src/ray/raylet/raylet", "--flag"]) == "raylet"
    assert process_kind(["python3", "-c", "import sys;exec(eval(sys.stdin.readline()))"]) == (
        "python:-c import sys;exec(eval(sys"
    )
    assert process_kind([]) == "kernel"


def test_a_process_alive_before_the_run_counts_only_its_growth() -> None:
    seen = [
        Seen("ray::Replica", 0.0, 4.0, before=False),
        Seen("ray::Replica", 0.5, 3.0, before=False),
        Seen("raylet", 100.0, 103.5, before=True),
    ]
    assert [(t.kind, t.processes, t.cpu_s) for t in totals(seen)] == [
        ("ray::Replica", 2, 7.0),
        ("raylet", 1, 3.5),
    ]


def test_a_process_keeps_its_kind_after_it_exits_and_its_cpu_is_counted() -> None:
    """A Ray worker exits as a zombie, whose command line reads empty: it stays what it was."""
    burn = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass"
    sampler = Sampler(0.05)
    sampler.sample()
    child = subprocess.Popen([sys.executable, "-c", burn])
    time.sleep(0.2)
    sampler.sample()  # seen alive, by its command line
    stat = Path(f"/proc/{child.pid}/stat")
    deadline = time.monotonic() + 30
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.02)
    sampler.sample()
    child.wait()
    (mine,) = [s for (pid, _), s in sampler.seen.items() if pid == str(child.pid)]
    assert mine.kind == "python:-c import time\nend = time.p"
    assert not mine.before and 0.55 <= mine.cpu <= 1.5
