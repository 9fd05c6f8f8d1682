"""The event pump: each live job's events from its supervisor into the store (that is what
makes them real), then acknowledged so that the supervisor can let them go. A restarted
service starts pumping again from the last stored sequence number."""

from __future__ import annotations

import asyncio

from elastic.job_state import JobState
from jobs import launcher
from service.control.book import JobBook
from service.control.records import Records
from service.control.supervisors import Supervisors

CALL_TIMEOUT_S = 10.0


class EventPump:
    def __init__(self, book: JobBook, records: Records, supervisors: Supervisors) -> None:
        self.book, self.records, self.supervisors = book, records, supervisors

    async def sync(self, job_id: str) -> None:
        """Bring the store up to date with the job's supervisor."""
        async with self.book.lock(job_id):
            job = await asyncio.to_thread(self.book.get, job_id)
            if JobState(job.state).is_terminal:
                self.book.forget(job_id)
                return
            handle = await self.supervisors.find(job)
            if handle is None:
                return
            try:
                events = await asyncio.wait_for(handle.events.remote(job.last_seq), CALL_TIMEOUT_S)
            except launcher.SupervisorGone as e:
                await self.supervisors.recreate_or_fail(job, f"the job's supervisor died: {e}")
                return
            except TimeoutError:
                return  # busy or on a node being declared dead: try next tick
            if not events:
                return
            job = await self.records.store_events(job_id, events)
            handle.ack.remote(events[-1]["seq"])
            if JobState(job.state).is_terminal:
                await self.supervisors.stop(handle, job_id)
