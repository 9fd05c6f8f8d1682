"""Queued jobs as rows: a submitted job waits as a row in the store and an entry in the
cluster scheduler's books, with no process of its own. The service books every such row
with the scheduler, launches a job's supervisor once the scheduler tells the job to start,
and, until then, writes why it waits into its event log (the supervisor does that from its
launch on).

A job that ran and went back to the queue (preempted) keeps its supervisor: only jobs that
never started are rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from elastic.cluster.capacity import RowDecision
from elastic.cluster.scheduling import Demand
from elastic.events import EventKind
from elastic.job_state import JobState
from jobs import launcher, queue
from jobs.spec import JobSpec
from service.control.book import JobBook
from service.control.records import Records
from service.control.supervisors import Supervisors
from service.store import JobRow, Store

log = logging.getLogger(__name__)

# The longest the rows wait for news of the scheduler before they are booked again; news
# (a job ended, a quota changed) and a submission or cancel here answer at once.
ROWS_WAIT_S = 2.0
# After a failed call to the scheduler (it is being re-created), before the next one.
RETRY_S = 1.0
# The least time between two bookings of the rows.
BOOK_EVERY_S = 0.2


def is_row(job: JobRow) -> bool:
    """Queued and never started: the jobs this module books (a supervisor may have been
    launched for it since; see :meth:`QueuedRows.with_supervisors`)."""
    return job.state == JobState.QUEUED.value and job.started_at is None


@dataclass
class _Row:
    demand: Demand
    said: str | None  # the last reason written into its event log


class QueuedRows:
    def __init__(
        self, namespace: str, store: Store, book: JobBook, records: Records, sups: Supervisors
    ) -> None:
        self.namespace, self.store, self.book = namespace, store, book
        self.records, self.supervisors = records, sups
        self.rows: dict[str, _Row] = {}
        # The rows whose supervisor asks the scheduler itself: the event pump follows them.
        self.supervised: set[str] = set()
        # Whether the scheduler's books hold no row of this service: until the first call,
        # they may hold a previous service process's, which that call unbooks.
        self._none_booked = False
        self._news = asyncio.Event()
        self._booked_at = -BOOK_EVERY_S

    def wake(self) -> None:
        """A row was added or ended: book the rows again now, not at the next wait's end."""
        self._news.set()

    def with_supervisors(self) -> list[str]:
        """The rows that have a supervisor now (launched, or asking the scheduler itself):
        the event pump follows them as it follows the jobs that started."""
        return [j for j in self.rows if j in self.book.handles or j in self.supervised]

    async def run(self) -> None:
        while True:
            try:
                await self._once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("booking the queued jobs with the scheduler failed")
                await asyncio.sleep(RETRY_S)

    async def _once(self) -> None:
        self._news.clear()
        await self._refresh(await asyncio.to_thread(self.store.row_ids))
        if (not self.rows and self._none_booked) or not launcher.is_connected():
            # Nothing to book or unbook: no call.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._news.wait(), ROWS_WAIT_S)
            return
        # A burst of submissions is booked a few at a time: each booking plans the whole
        # cluster again, and one per submission kept the scheduler from its other callers.
        await asyncio.sleep(max(0.0, self._booked_at + BOOK_EVERY_S - time.monotonic()))
        demands = [row.demand for row in self.rows.values()]
        version, decisions = await queue.hold_rows(self.namespace, demands)
        self._booked_at = time.monotonic()
        self._none_booked = not demands
        self.supervised = {job_id for job_id, d in decisions.items() if d.supervised}
        for job_id, decision in decisions.items():
            await self._act(job_id, decision)
        if not self._news.is_set():
            # Until the scheduler's books change (a job ended, a quota changed), or a row
            # is added or ends here: whichever comes first.
            waited = asyncio.ensure_future(queue.news_after(self.namespace, version, ROWS_WAIT_S))
            news = asyncio.ensure_future(self._news.wait())
            done, pending = await asyncio.wait({waited, news}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if waited in done:
                waited.result()  # a failed call is the loop's to log and retry

    async def _refresh(self, ids: list[str]) -> None:
        """The rows now: a new one's demand is built once (a spec that cannot be read fails
        its job here, as a launch would), an ended one's is dropped."""
        live = set(ids)
        self.rows = {job_id: row for job_id, row in self.rows.items() if job_id in live}
        self.supervised &= live
        for job_id in ids:
            if job_id in self.rows:
                continue
            job = await asyncio.to_thread(self.store.get_job, job_id)
            if job is None or not is_row(job):
                continue  # it started or ended since
            try:
                spec = JobSpec.model_validate(job.spec)
            except Exception as e:
                # Under the job's lock, as a launch fails it: the second to come finds the
                # job ended, and its end is stored and told once.
                async with self.book.lock(job.id):
                    await self.supervisors.end_without_supervisor(
                        job.id, JobState.FAILED, f"could not start the job on Ray: {e}"
                    )
                continue
            demand = queue.demand(job.id, spec, job.owner, job.created_at.timestamp())
            self.rows[job.id] = _Row(demand, await asyncio.to_thread(self._last_reason, job))

    def _last_reason(self, job: JobRow) -> str | None:
        """What a row last said (a service restarted over it does not say it twice)."""
        last = self.store.events(job.id, after=job.last_seq - 1, limit=1)
        if last and last[0].kind == EventKind.WAITING:
            return str(last[0].data.get("reason"))
        return None

    async def _act(self, job_id: str, decision: RowDecision) -> None:
        row = self.rows.get(job_id)
        if row is None or decision.supervised or job_id in self.book.handles:
            return
        if decision.starts:
            self.supervisors.request_launch(job_id)
            return
        reason = None if decision.target is None else decision.target.reason
        if reason is None or reason == row.said:
            return
        async with self.book.lock(job_id):
            job = await asyncio.to_thread(self.store.get_job, job_id)
            # Launched or ended meanwhile: its supervisor, or nobody, writes its log now.
            if job is None or not is_row(job) or job_id in self.book.handles:
                return
            event = {
                "seq": job.last_seq + 1,
                "kind": EventKind.WAITING,
                "time": time.time(),
                "data": {"reason": reason},
            }
            await self.records.store_events(job_id, [event])
        row.said = reason
