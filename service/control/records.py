"""A job's events into the store, then out to its live readers: nothing is sent that is not
stored first."""

from __future__ import annotations

import asyncio
from typing import Any

from elastic.events import EventKind
from service.control.book import JobBook
from service.schemas import JobOut
from service.store import JobRow, Store, with_relative_paths
from service.streams import Hub

# Job-level changes that the all-jobs stream carries (besides "created").
ANNOUNCED = (EventKind.STATE, EventKind.RESIZED)


class Records:
    def __init__(self, store: Store, hub: Hub, book: JobBook) -> None:
        self.store, self.hub, self.book = store, hub, book

    async def store_events(self, job_id: str, events: list[dict[str, Any]]) -> JobRow:
        delivered = self.book.delivered.setdefault(job_id, {})
        for event in events:
            origin = event.pop("origin", None)  # the worker's numbered news it records
            if origin is not None:
                sender, n = origin
                delivered[sender] = max(delivered.get(sender, -1), int(n))
        events = with_relative_paths(job_id, events)
        job = await asyncio.to_thread(self.store.append_events, job_id, events)
        self.hub.publish(job_id, events)
        for kind in dict.fromkeys(e["kind"] for e in events if e["kind"] in ANNOUNCED):
            self.announce(kind, job)
        return job

    def announce(self, kind: str, job: JobRow) -> None:
        self.hub.publish_all(
            {"type": kind, "job": JobOut.model_validate(job).model_dump(mode="json")}
        )
