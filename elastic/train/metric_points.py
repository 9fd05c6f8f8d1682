"""Metric points a command job's process sends (``elastic_train.report``), one JSON object
a line, made into the job's metrics reports: one per step, the values of several calls for
the same step merged, a point sent once the next step's arrives or ``HOLD_S`` after its
first value."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from typing import Any

HOLD_S = 0.5
MAX_VALUES = 64  # metrics per point; more are dropped (a point is a row, not a log)
MAX_NAME = 64


def parse(line: bytes) -> dict[str, Any] | None:
    """A point (``step`` an integer of at least 0, every other value a finite number or
    null), or None for a line that is not one."""
    try:
        raw = json.loads(line)
    except ValueError:
        return None
    if not isinstance(raw, dict):
        return None
    step = raw.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return None
    point: dict[str, Any] = {"step": step}
    for name, value in list(raw.items())[: MAX_VALUES + 1]:
        if name == "step" or not isinstance(name, str) or len(name) > MAX_NAME:
            continue
        if value is None or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(float(value))
        ):
            point[name] = None if value is None else float(value)
    return point


class PointMerger:
    def __init__(
        self, send: Callable[[dict[str, Any]], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.send, self.clock = send, clock
        self._pending: dict[str, Any] | None = None
        self._since = 0.0
        self._lock = threading.Lock()

    def add_line(self, line: bytes) -> None:
        point = parse(line)
        if point is not None:
            self.add(point)

    def add(self, point: dict[str, Any]) -> None:
        with self._lock:
            ready = None
            if self._pending is not None and self._pending["step"] != point["step"]:
                ready, self._pending = self._pending, None
            if self._pending is None:
                self._pending, self._since = dict(point), self.clock()
            else:
                self._pending.update(point)
        if ready is not None:
            self.send(ready)

    def tick(self) -> None:
        """Send the pending point once it has waited ``HOLD_S``."""
        with self._lock:
            ready = None
            if self._pending is not None and self.clock() - self._since >= HOLD_S:
                ready, self._pending = self._pending, None
        if ready is not None:
            self.send(ready)

    def flush(self) -> None:
        with self._lock:
            ready, self._pending = self._pending, None
        if ready is not None:
            self.send(ready)
