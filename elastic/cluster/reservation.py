"""What ``CapacitySource.reserve`` answers: capacity held for one job. Apart from the
capacity source, which talks to Ray, so that the runners' protocol can name it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reservation:
    """Capacity held for one job until its next attempt starts; a grow's, one worker's
    each, for as long as the worker placed on it lives."""

    workers: int
    handle: Any = None  # the source's own (a Ray placement group)
