"""The ctx port of each example script (loop.py) stays a small diff of the plain script
(main.py): at most 15 lines added and 10 removed, the budget docs/custom-code.md prints
the ports against."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
BUDGET = (15, 10)
NAMES = ["mnist", "resnet", "text"]


def counts(a: Path, b: Path) -> tuple[int, int]:
    diff = difflib.unified_diff(a.read_text().splitlines(), b.read_text().splitlines(), n=0)
    lines = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
    return sum(line.startswith("+") for line in lines), sum(line.startswith("-") for line in lines)


@pytest.mark.parametrize("name", NAMES)
def test_the_ctx_port_stays_within_its_diff_budget(name: str) -> None:
    added, removed = counts(EXAMPLES / name / "main.py", EXAMPLES / name / "loop.py")
    most_added, most_removed = BUDGET
    assert added <= most_added and removed <= most_removed, (
        f"{name}: loop.py is +{added}/-{removed} from main.py, over +{most_added}/-{most_removed}"
    )
