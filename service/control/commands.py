"""The job control: what the routes ask of it (submit, cancel, push the quotas), and the
background tasks that keep the store in step with the cluster."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from elastic.job_state import JobState
from jobs import cluster, launcher
from jobs.spec import JobSpec
from service.control.admission import Admission, fingerprint
from service.control.book import JobBook
from service.control.maintenance import Maintenance
from service.control.pump import CALL_TIMEOUT_S, EventPump
from service.control.queued_rows import QueuedRows
from service.control.records import Records
from service.control.supervisors import Supervisors
from service.errors import IdempotencyKeyReused, JobAlreadyEnded, SubmissionInProgress
from service.settings import Settings
from service.store import JobRow, Store
from service.streams import Hub

log = logging.getLogger(__name__)

# A key reserved this long without a job belongs to a submission that died with the
# process (a real one takes seconds): a retry may take it over.
IDEMPOTENCY_STALE_S = 120.0


class JobControl:
    def __init__(self, settings: Settings, store: Store, hub: Hub) -> None:
        self.settings = settings
        self.store = store
        # The nodes' totals for the fit and memory checks, refreshed in the background.
        self.cluster = cluster.ResourceView()
        self.book = JobBook(store)
        self.records = Records(store, hub, self.book)
        self.admission = Admission(settings, store, self.cluster)
        self.supervisors = Supervisors(settings, store, self.book, self.records)
        self.pump = EventPump(self.book, self.records, self.supervisors)
        self.rows = QueuedRows(
            settings.ray_namespace, store, self.book, self.records, self.supervisors
        )
        self.maintenance = Maintenance(settings, store)
        self._admitting: dict[str, asyncio.Lock] = {}  # owner -> one admission at a time
        self._tasks: list[asyncio.Task[None]] = []

    # -- commands -----------------------------------------------------------------------

    async def submit_once(
        self, spec: JobSpec, owner: str, idempotency_key: str | None
    ) -> tuple[JobRow, bool]:
        """(the job, whether it is a replay): with ``idempotency_key``, a retry with the same
        key and spec gets the job the first submission made, not a second one."""
        if idempotency_key is None:
            return await self.submit(spec, owner), False
        key_print = fingerprint(spec)
        held = await asyncio.to_thread(
            self.store.claim_idempotency_key,
            owner,
            idempotency_key,
            key_print,
            IDEMPOTENCY_STALE_S,
        )
        if held is not None:
            if held.fingerprint != key_print:
                raise IdempotencyKeyReused(idempotency_key)
            if held.job_id is None:
                raise SubmissionInProgress(idempotency_key)
            return await asyncio.to_thread(self.book.get, held.job_id), True
        try:
            return await self.submit(spec, owner, idempotency_key), False
        except BaseException:
            await asyncio.to_thread(self.store.release_idempotency_key, owner, idempotency_key)
            raise

    async def submit(self, spec: JobSpec, owner: str, idempotency_key: str | None = None) -> JobRow:
        # One admission at a time per user: two submissions cannot both take the last slot.
        async with self._admitting.setdefault(owner, asyncio.Lock()):
            spec = await asyncio.to_thread(self.admission.check, spec, owner)
            job = await asyncio.to_thread(
                self.store.create_job,
                spec.name,
                owner,
                spec.workload,
                spec.model_dump(mode="json"),
                idempotency_key,
            )
        self.records.announce("created", job)
        # The job is stored: it waits as a row, booked with the cluster's scheduler now (or
        # by the next service process, if this one dies first), and gets a supervisor when
        # the scheduler tells it to start.
        self.rows.wake()
        return job

    def request_launch(self, job_id: str) -> None:
        self.supervisors.request_launch(job_id)

    async def cancel(self, job_id: str, reason: str = "cancelled by the user") -> JobRow:
        # Under the job's lock: a launch in progress finishes first, so the cancel either
        # finds its supervisor or leaves nothing for the launcher to start.
        namespace = self.settings.ray_namespace
        async with self.book.lock(job_id):
            job = await asyncio.to_thread(self.book.get, job_id)
            if JobState(job.state).is_terminal:
                raise JobAlreadyEnded(job.state)
            handle = self.book.handles.get(job_id) or await asyncio.to_thread(
                launcher.find_supervisor, job_id, namespace
            )
            if handle is None:
                await self.supervisors.end_without_supervisor(job_id, JobState.CANCELLED, reason)
                self.rows.wake()  # off the scheduler's books now
        if handle is not None:
            try:
                await asyncio.wait_for(handle.cancel.remote(reason), CALL_TIMEOUT_S)
            except launcher.SupervisorGone:
                await self.supervisors.end_without_supervisor(job_id, JobState.CANCELLED, reason)
            except TimeoutError:
                # It does not answer (busy, or on a node being declared dead): end it anyway,
                # and its attempt with it, so that nothing keeps running for a cancelled job.
                await asyncio.to_thread(launcher.stop_supervisor, handle, job_id, namespace)
                self.book.handles.pop(job_id, None)
                await self.supervisors.end_without_supervisor(job_id, JobState.CANCELLED, reason)
                await self.supervisors.off_the_schedulers_book(job_id)
        await self.pump.sync(job_id)
        return await asyncio.to_thread(self.book.get, job_id)

    async def push_quotas(self) -> None:
        await self.maintenance.push_quotas()

    # -- the background tasks -------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run()),
            loop.create_task(self.supervisors.launch_queued()),
            loop.create_task(self.rows.run()),
            loop.create_task(self.cluster.keep_fresh()),
            loop.create_task(self.maintenance.keep_quotas_pushed()),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []

    async def _run(self) -> None:
        purged_at: float | None = None
        while True:
            try:
                # A queued job with no supervisor has no events but the rows' own.
                jobs = await asyncio.to_thread(self.store.active_jobs, rows=False)
                followed = [j.id for j in jobs] + self.rows.with_supervisors()
                # One job's failure to sync (an event its store fold refused) is that job's:
                # the others' events, and the overtime checks below, go on.
                synced = await asyncio.gather(
                    *(self.pump.sync(job_id) for job_id in followed), return_exceptions=True
                )
                for job_id, outcome in zip(followed, synced, strict=True):
                    if isinstance(outcome, Exception):
                        log.error("syncing job %s failed", job_id, exc_info=outcome)
                for job_id, why in await self.maintenance.overtime(jobs):
                    with contextlib.suppress(JobAlreadyEnded):  # it ended meanwhile
                        await self.cancel(job_id, why)
                every = self.maintenance.purge_every_s()
                if purged_at is None or time.monotonic() - purged_at > every:
                    purged_at = time.monotonic()
                    await self.maintenance.purge_old_data()
            except asyncio.CancelledError:
                raise
            except RuntimeError as e:
                # The loop's thread pool is shut down: the process is exiting without the
                # lifespan's stop(); a traceback per tick would only bury the real output.
                if "after shutdown" in str(e):
                    return
                log.exception("event pump tick failed")
            except Exception:
                log.exception("event pump tick failed")
            await asyncio.sleep(self.settings.event_poll_interval_s)
