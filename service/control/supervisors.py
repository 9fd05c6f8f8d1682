"""Each job's supervisor, as the service sees it: launched in the background once the
cluster's scheduler tells the queued job to start (``queued_rows.py``), found again after a
restart of the service, re-created when it died, and stopped when its job has ended. When
no supervisor can write a job's log any more, the service writes the job's end itself."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from elastic.events import EventKind
from elastic.job_state import JobState
from jobs import launcher, queue
from jobs.spec import JobSpec
from service.control.admission import data_access
from service.control.book import JobBook
from service.control.records import Records
from service.settings import Settings
from service.store import JobRow, Store

log = logging.getLogger(__name__)

# A supervisor not found this long after its job's last change is gone, not late.
MISSING_GRACE_S = 5.0
# How many times one service process re-creates the supervisor of one job before it gives
# up on the job: a supervisor that dies again and again is not saved by one more.
MAX_RECREATIONS = 3
# How long the launcher waits for a new supervisor to answer before it starts the next one.
LAUNCH_READY_TIMEOUT_S = 30.0


class Supervisors:
    def __init__(self, settings: Settings, store: Store, book: JobBook, records: Records) -> None:
        self.settings, self.store, self.book, self.records = settings, store, book, records
        # The jobs the scheduler told to start get their supervisors from ``launch_queued``,
        # in order, one at a time.
        self._launches: asyncio.Queue[str] = asyncio.Queue()
        self._to_launch: set[str] = set()

    @property
    def namespace(self) -> str:
        return self.settings.ray_namespace

    def request_launch(self, job_id: str) -> None:
        """Start the stored, queued job's supervisor in the background (once, however often
        asked: the rows ask on every word of the scheduler until it runs); a launch that
        fails fails the job, with the reason in its event log."""
        if job_id not in self._to_launch:
            self._to_launch.add(job_id)
            self._launches.put_nowait(job_id)

    async def launch_queued(self) -> None:
        """Start the supervisors of the jobs told to start, in the order asked, one at a
        time, each waited for until it answers. Starting one is a new Ray worker process: a burst of
        submissions started all at once took every core of a small head node from the API
        (bench/api_load.py), and a job cancelled while it waits here is never started."""
        while True:
            job_id = await self._launches.get()
            try:
                async with self.book.lock(job_id):
                    self._to_launch.discard(job_id)
                    job = await asyncio.to_thread(self.store.get_job, job_id)
                    if job is None or job.state != JobState.QUEUED.value:
                        continue  # cancelled (or launched by a pump tick) meanwhile
                    if self.book.handles.get(job_id) is not None:
                        continue
                    handle = await self.launch(job)
                if handle is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            handle.__ray_ready__.remote(), LAUNCH_READY_TIMEOUT_S
                        )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("launching %s failed", job_id)

    async def launch(self, job: JobRow, resume: launcher.Resume | None = None) -> Any | None:
        """The new supervisor's handle; None when it could not be started, and then the job
        has failed with the reason in its event log."""
        try:
            spec = JobSpec.model_validate(job.spec)
            handle = await asyncio.to_thread(
                launcher.launch,
                job.id,
                spec,
                self.settings.resolved_checkpoint_dir,
                self.namespace,
                job.last_seq + 1,
                resume,
                job.owner,
                job.created_at.timestamp(),
                data_access(self.settings).readable_trees(job.owner),
                self.settings.warm_processes_per_node > 0,
            )
            self.book.handles[job.id] = handle
            return handle
        except Exception as e:
            log.exception("could not launch %s", job.id)
            await self.end_without_supervisor(
                job.id, JobState.FAILED, f"could not start the job on Ray: {e}"
            )
            return None

    async def find(self, job: JobRow) -> Any | None:
        """The live job's supervisor; None when there is none now (then it is launched,
        waited for a moment, or re-created, as the job's state calls for)."""
        handle = self.book.handles.get(job.id)
        if handle is None:
            handle = await asyncio.to_thread(launcher.find_supervisor, job.id, self.namespace)
            if handle is None:
                await self._missing(job)
                return None
            # A service killed right after a launch can take the supervisor's `start` call
            # with it (the call waits in the killed process until the actor is up): the
            # supervisor would sit idle forever. Starting is idempotent: ask again.
            handle.start.remote()
        self.book.handles[job.id] = handle
        self.book.missing_since.pop(job.id, None)
        return handle

    async def _missing(self, job: JobRow) -> None:
        if job.state == JobState.QUEUED.value and job.started_at is None:
            # A row: launched when the scheduler tells it to start (service/control/
            # queued_rows.py). A job that ran and was preempted back to the queue had a
            # supervisor: it is re-created like a running job's.
            return
        first = self.book.missing_since.setdefault(job.id, time.monotonic())
        if time.monotonic() - first < MISSING_GRACE_S:
            return
        await self.recreate_or_fail(
            job, "the job's supervisor is gone from Ray (the cluster restarted or lost its node)"
        )

    async def recreate_or_fail(self, job: JobRow, why: str) -> None:
        """A job whose supervisor died goes on under a new one, from its latest checkpoint,
        or from step 0 when it saved none (the new supervisor says which in an event); one
        re-created MAX_RECREATIONS times already fails with ``why``."""
        self.book.handles.pop(job.id, None)
        times = self.book.recreated.get(job.id, 0)
        if times >= MAX_RECREATIONS:
            why = f"{why}; it was re-created {times} times already"
            await self.end_without_supervisor(job.id, JobState.FAILED, why)
            return
        self.book.recreated[job.id] = times + 1
        self.book.missing_since.pop(job.id, None)
        # The new supervisor finds the latest valid checkpoint (or none) and says which.
        log.warning("%s: %s; re-creating its supervisor", job.id, why)
        resume = launcher.Resume(
            job.state, job.step or 0, job.world_size or 0, dict(self.book.delivered.get(job.id, {}))
        )
        await self.launch(job, resume)

    async def stop(self, handle: Any, job_id: str) -> None:
        """The job has ended, or its supervisor does not answer a cancel: end the supervisor
        and its attempt, and free the job's workers for the next job now."""
        # A GCS call: on the event loop it held every request while it ran.
        await asyncio.to_thread(launcher.stop_supervisor, handle, job_id, self.namespace)
        self.book.forget(job_id)
        await self.off_the_schedulers_book(job_id)

    async def off_the_schedulers_book(self, job_id: str) -> None:
        """The ended job's workers are free for the next job now, not at the scheduler's next
        check (see jobs.queue.forget)."""
        try:
            await queue.forget(self.namespace, job_id)
        except Exception as e:  # it finds the stopped supervisor gone by itself anyway
            log.warning("telling the scheduler that %s ended failed: %s", job_id, e)

    async def end_without_supervisor(self, job_id: str, state: JobState, reason: str) -> None:
        """Only when no supervisor can write the log any more does the service write it."""
        job = await asyncio.to_thread(self.book.get, job_id)
        if JobState(job.state).is_terminal:
            return
        event = {
            "seq": job.last_seq + 1,
            "kind": EventKind.STATE,
            "time": time.time(),
            "data": {"state": state.value, "previous": job.state, "reason": reason},
        }
        await self.records.store_events(job_id, [event])
        self.book.forget(job_id)
        try:
            await asyncio.to_thread(launcher.end_attempt_leftovers, job_id, self.namespace)
        except Exception as e:  # Ray unreachable: what is left of the job dies with it
            log.warning("ending what is left of %s's attempt failed: %s", job_id, e)
