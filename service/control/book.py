"""What the control remembers of each live job between ticks, and the lock that orders what
happens to one job (a launch, a sync, a cancel)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from service.errors import JobNotFound
from service.store import JobRow, Store


@dataclass
class JobBook:
    store: Store
    handles: dict[str, Any] = field(default_factory=dict)  # job -> its supervisor's handle
    missing_since: dict[str, float] = field(default_factory=dict)
    recreated: dict[str, int] = field(default_factory=dict)
    # job -> per sender of its workers' numbered news, the last number stored: what a
    # re-created supervisor does not take twice (elastic/in_place/supervisor_link.py)
    delivered: dict[str, dict[str, int]] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def lock(self, job_id: str) -> asyncio.Lock:
        return self.locks.setdefault(job_id, asyncio.Lock())

    def forget(self, job_id: str) -> None:
        self.handles.pop(job_id, None)
        self.missing_since.pop(job_id, None)
        self.recreated.pop(job_id, None)
        self.delivered.pop(job_id, None)

    def get(self, job_id: str) -> JobRow:
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job
