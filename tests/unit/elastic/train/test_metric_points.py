"""A command job's reported points become one metrics report per step."""

from __future__ import annotations

from typing import Any

from elastic.train.metric_points import HOLD_S, PointMerger, parse


def test_a_point_is_a_step_and_finite_numbers() -> None:
    assert parse(b'{"step": 3, "loss": 0.5, "acc": 1, "note": "x", "lr": null}\n') == {
        "step": 3,
        "loss": 0.5,
        "acc": 1.0,
        "lr": None,
    }
    for line in [b"not json", b"[1]", b'{"loss": 1}', b'{"step": -1}', b'{"step": true}']:
        assert parse(line) is None, line
    assert parse(b'{"step": 1, "loss": NaN, "big": 1e999}') == {"step": 1}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_calls_for_one_step_merge_and_a_new_step_sends_the_last() -> None:
    sent: list[dict[str, Any]] = []
    clock = Clock()
    points = PointMerger(sent.append, clock)
    points.add({"step": 1, "loss": 2.0})
    points.add({"step": 1, "eval_loss": 3.0})
    assert sent == []
    points.add({"step": 2, "loss": 1.0})
    assert sent == [{"step": 1, "loss": 2.0, "eval_loss": 3.0}]
    clock.now += HOLD_S - 0.01
    points.tick()
    assert len(sent) == 1
    clock.now += 0.02
    points.tick()
    assert sent[-1] == {"step": 2, "loss": 1.0}
    points.flush()
    assert len(sent) == 2
    points.add_line(b'{"step": 3, "loss": 0.5}')
    points.flush()
    assert sent[-1] == {"step": 3, "loss": 0.5}
