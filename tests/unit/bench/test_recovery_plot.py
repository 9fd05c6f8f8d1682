"""The recovery bench's plot, from hand-made records.json files laid out as bench.recovery
writes them: which run stands for each side, and that a PNG of a sane size comes out."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from matplotlib.image import imread

from bench.recovery_plot import load, main, points, representative
from bench.recovery_records import StepRecord

BATCH = 6
PNG = b"\x89PNG\r\n\x1a\n"


def steps(
    attempt: str, first: int, last: int, world: int, t0: float, dt: float, committed: bool = True
) -> list[StepRecord]:
    """One record per rank per step, each rank with its share of the step's samples."""
    out = []
    for n, step in enumerate(range(first, last + 1)):
        share = BATCH // world
        for rank in range(world):
            start = (step - 1) * BATCH + rank * share
            indices = tuple(range(start, start + share))
            out.append(StepRecord(t0 + n * dt, rank, step, attempt, world, committed, indices))
    return out


def in_place(work: Path, rep: int, recovery_s: float) -> None:
    """Steps 1-24 at 3 (a step each 0.05 s from t=100), killed 0.01 s after step 24; step 25
    tried at 3 and thrown away; from ``recovery_s`` after the kill steps at 2; a node back
    at step 40, steps at 3 from 4 s after it, to step 120."""
    records = steps("x", 1, 24, 3, 100.0, 0.05)
    killed = records[-1].time + 0.01
    records += steps("x", 25, 25, 3, killed + 0.05, 0.05, committed=False)
    records += steps("x", 25, 40, 2, killed + recovery_s, 0.05)
    added = records[-1].time + 0.02
    records += steps("x", 41, 120, 3, added + 4.0, 0.05)
    save(work / f"in_place-{rep}", records, 99.0, killed, added)


def restart(work: Path, rep: int, recovery_s: float) -> None:
    """Steps 1-27 at 3, killed after step 24; a new attempt from the checkpoint at step 20
    at 2, ``recovery_s`` after the kill; a node back at step 40, and a restart at 3 from
    the checkpoint at step 40, 3.5 s after it."""
    records = steps("1", 1, 27, 3, 100.0, 0.05)
    killed = records[-1].time - 0.13
    records += steps("2", 21, 42, 2, killed + recovery_s, 0.05)
    added = records[-3].time + 0.01
    records += steps("3", 41, 120, 3, added + 3.5, 0.05)
    save(work / f"restart-{rep}", records, 99.0, killed, added)


def save(
    where: Path, records: list[StepRecord], started: float, killed: float, added: float
) -> None:
    where.mkdir(parents=True)
    (where / "records.json").write_text(
        json.dumps(
            {
                "started": started,
                "killed_at": killed,
                "added_at": added,
                "records": [dataclasses.astuple(r) for r in records],
            }
        )
    )


def test_the_command_draws_each_sides_median_run_into_a_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    for rep, recovery_s in enumerate([0.46, 0.36, 0.42]):
        in_place(work, rep, recovery_s)
    # An even number of runs: the lower of the middle two (1.6 s, not 1.7 s).
    for rep, recovery_s in enumerate([1.9, 1.5, 1.7, 1.6]):
        restart(work, rep, recovery_s)
    (work / "notes").mkdir()  # no records.json: not a run
    out = tmp_path / "img" / "recovery.png"
    monkeypatch.setattr(sys, "argv", ["recovery_plot", str(work), "--out", str(out)])
    main()

    # The sides in bench.recovery's order, each with the run of its median recovery.
    assert capsys.readouterr().out.splitlines() == [
        f"restart: {work / 'restart-3' / 'records.json'}",
        f"in_place: {work / 'in_place-2' / 'records.json'}",
        f"plot: {out}",
    ]
    data = out.read_bytes()
    assert data[:8] == PNG
    assert 20_000 < len(data) < 2_000_000
    height, width, _ = imread(out).shape
    assert 1000 <= width <= 1400
    assert 400 <= height <= 1000  # two panels and the legend


def test_the_representative_run_and_its_points(tmp_path: Path) -> None:
    for rep, recovery_s in enumerate([0.5, 0.3, 0.3, 0.4, 0.5]):
        in_place(tmp_path, rep, recovery_s)
    runs = [load(tmp_path / f"in_place-{rep}" / "records.json") for rep in range(5)]
    assert [r.recovery_s for r in runs] == pytest.approx([0.5, 0.3, 0.3, 0.4, 0.5])
    assert representative(runs) is runs[3]
    # Of equal ones, the first given.
    assert representative(runs[:3]) is runs[1]
    assert runs[0].grown_at == pytest.approx(runs[0].added_at + 4.0)

    restart(tmp_path, 9, 1.6)
    run = load(tmp_path / "restart-9" / "records.json")
    drawn = points(run)
    # One point per attempt's step, whatever its ranks: the first attempt's steps 21-27 were
    # redone by the second, whose steps 41-42 the third redid.
    assert len(drawn) == 27 + 22 + 80
    lost = sorted((p.step, p.world) for p in drawn if p.kind == "lost")
    assert lost == [(s, 3) for s in range(21, 28)] + [(41, 2), (42, 2)]
    assert not any(p.kind == "thrown" for p in drawn)
    thrown = [p for p in points(runs[0]) if p.kind == "thrown"]
    assert [(p.step, p.world) for p in thrown] == [(25, 3)]
