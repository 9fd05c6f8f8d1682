"""Every time the API answers is ISO 8601 UTC, and a JSON page writes an event exactly as
its SSE stream does (clients compare the two)."""

from __future__ import annotations

import random

from service.schemas import EventOut, LogLine, event_json, iso_time


def test_unix_seconds_are_written_as_utc_with_z_like_the_jobs_times() -> None:
    assert iso_time(0.0) == "1970-01-01T00:00:00Z"
    assert iso_time(1_795_428_000.25) == "2026-11-23T10:00:00.250000Z"


def test_a_log_event_has_its_time_and_its_lines_times_converted_and_nothing_else() -> None:
    event = {
        "seq": 7,
        "kind": "log",
        "time": 1_795_428_001.5,
        "data": {"rank": 1, "attempt": 2, "lines": [[1_795_428_000.0, "stderr", "oops"]]},
    }
    assert event_json(event) == {
        "seq": 7,
        "kind": "log",
        "time": "2026-11-23T10:00:01.500000Z",
        "data": {"rank": 1, "attempt": 2, "lines": [["2026-11-23T10:00:00Z", "stderr", "oops"]]},
    }
    metrics = {"seq": 8, "kind": "metrics", "time": 0.0, "data": {"step": 3, "lines": 5}}
    assert event_json(metrics)["data"] == {"step": 3, "lines": 5}  # only log events have lines


def test_a_page_and_a_stream_write_the_same_time() -> None:
    rng = random.Random(0)
    for _ in range(5000):
        t = rng.uniform(1.7e9, 1.9e9)
        streamed = event_json({"seq": 1, "kind": "state", "time": t, "data": {}})
        paged = EventOut.model_validate(streamed).model_dump(mode="json")
        assert paged == streamed
        line = LogLine(seq=1, rank=0, attempt=1, time=t, stream="stdout", line="x")
        assert line.model_dump(mode="json")["time"] == streamed["time"]
