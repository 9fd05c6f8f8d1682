"""The ctx port of each example script (loop.py) stays a small diff of the plain script
(main.py): the budgets below are today's counts, so a port cannot grow without a word.
The aim was +15/-10; examples/README.md says where each port spends more and why."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
BUDGETS = {"mnist": (16, 15), "resnet": (20, 15), "text": (18, 14)}


def counts(a: Path, b: Path) -> tuple[int, int]:
    diff = difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), n=0)
    lines = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
    return sum(line.startswith("+") for line in lines), sum(line.startswith("-") for line in lines)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_the_ctx_port_stays_within_its_diff_budget(name: str) -> None:
    added, removed = counts(EXAMPLES / name / "main.py", EXAMPLES / name / "loop.py")
    most_added, most_removed = BUDGETS[name]
    assert added <= most_added and removed <= most_removed, (
        f"{name}: loop.py is +{added}/-{removed} from main.py, over +{most_added}/-{most_removed}"
    )
