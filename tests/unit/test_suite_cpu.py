"""The CPU accounting of bench/suite_cpu.py: what each process counts as, and the totals."""

from __future__ import annotations

from bench.suite_cpu import Seen, process_kind, totals


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
