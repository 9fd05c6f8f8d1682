"""``elastic_train.report(step=..., loss=..., **more)``: a point of a command job's metrics.

For scripts run as a command job (``command: [...]`` in the job spec): the point reaches
the job's metrics, so the dashboard, ``etrain``, Prometheus and TensorBoard show it as they
show any job's. It imports neither Ray nor torch, and outside a job it does nothing, so a
script that calls it still runs on its own. Any rank may call it; rank 0's points are kept.
Values are numbers (a tensor: call ``.item()``) or None; several calls for one step within
half a second make one point.
"""

from __future__ import annotations

import json
import os

_FD_ENV = "ETRAIN_REPORT_FD"  # set by the worker that runs the command
# One write of at most this many bytes to a pipe is never interleaved with another's.
_MAX_LINE = 4096


def report(step: int, **metrics: float | int | None) -> bool:
    """Send one point; returns whether it was sent (False outside a job)."""
    fd = os.environ.get(_FD_ENV)
    if not fd:
        return False
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer of at least 0, not {step!r}")
    for name, value in metrics.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise TypeError(f"{name} must be a number or None, not {type(value).__name__}")
    line = (json.dumps({"step": step, **metrics}, allow_nan=False) + "\n").encode()
    if len(line) > _MAX_LINE:
        raise ValueError(f"a point is at most {_MAX_LINE} bytes of JSON, not {len(line)}")
    try:
        os.write(int(fd), line)
    except OSError:  # the worker is gone: the job is ending
        return False
    return True
