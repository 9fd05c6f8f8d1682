"""``elastic_train.report``: a line on the worker's pipe, or nothing outside a job."""

from __future__ import annotations

import contextlib
import json
import os

import pytest

import elastic_train
from elastic_train.reporting import report


def test_outside_a_job_it_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ETRAIN_REPORT_FD", raising=False)
    assert report(step=1, loss=0.5) is False
    assert elastic_train.report is report


def test_a_point_goes_down_the_pipe_as_one_json_line(monkeypatch: pytest.MonkeyPatch) -> None:
    read, write = os.pipe()
    monkeypatch.setenv("ETRAIN_REPORT_FD", str(write))
    try:
        assert report(step=7, loss=0.25, accuracy=1, lr=None) is True
        assert report(step=8) is True
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            lines = pipe.read().splitlines()
    finally:
        for fd in (read, write):
            with contextlib.suppress(OSError):  # the reader closed its own already
                os.close(fd)
    assert [json.loads(line) for line in lines] == [
        {"step": 7, "loss": 0.25, "accuracy": 1, "lr": None},
        {"step": 8},
    ]


def test_a_bad_point_is_refused_before_anything_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETRAIN_REPORT_FD", "99999")
    with pytest.raises(ValueError, match="step"):
        report(step=-1)
    with pytest.raises(TypeError, match="loss"):
        report(step=1, loss="low")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Out of range float"):
        report(step=1, loss=float("nan"))
    with pytest.raises(ValueError, match="4096"):
        report(step=1, **{f"m{i}": 1.0 for i in range(500)})
