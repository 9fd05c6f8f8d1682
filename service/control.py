"""Submitting, cancelling and following jobs: the store on one side, Ray on the other.

The event pump collects each live job's events from its supervisor, stores them (that is
what makes them real), then acknowledges them so the supervisor can let them go. A
restarted service simply starts pumping again from the last stored sequence number.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from elastic.events import EventKind
from elastic.job_state import JobState
from jobs import cluster, isolation, launcher, memory, queue
from jobs.spec import JobSpec
from jobs.workloads.data_paths import DataAccess, PathRefused
from service import quotas
from service.errors import (
    IdempotencyKeyReused,
    JobAlreadyEnded,
    JobNotFound,
    SubmissionInProgress,
)
from service.problems import Problem
from service.quotas import Usage, UserLimits
from service.schemas import JobOut
from service.settings import Settings
from service.store import JobRow, Store, with_relative_paths
from service.streams import Hub

log = logging.getLogger(__name__)

# A supervisor not found this long after its job's last change is gone, not late.
MISSING_GRACE_S = 5.0
CALL_TIMEOUT_S = 10.0
# How many times one service process re-creates the supervisor of one job before it gives
# up on the job: a supervisor that dies again and again is not saved by one more.
MAX_RECREATIONS = 3
# How often finished jobs' old metrics and logs are deleted (ETRAIN_RETENTION_DAYS).
PURGE_EVERY_S = 600.0
# Job-level changes that the all-jobs stream carries (besides "created").
ANNOUNCED = (EventKind.STATE, EventKind.RESIZED)
# How long the launcher waits for a new supervisor to answer before it starts the next one.
LAUNCH_READY_TIMEOUT_S = 30.0
# A key reserved this long without a job belongs to a submission that died with the
# process (a real one takes seconds): a retry may take it over.
IDEMPOTENCY_STALE_S = 120.0
# How often the quotas are pushed to the scheduler again although none changed: a scheduler
# re-created after its death (its node lost, killed by hand) starts with none.
QUOTAS_REPUSH_S = 30.0


class JobControl:
    def __init__(self, settings: Settings, store: Store, hub: Hub) -> None:
        self.settings = settings
        self.store = store
        self.hub = hub
        self._handles: dict[str, Any] = {}
        self._missing_since: dict[str, float] = {}
        self._recreated: dict[str, int] = {}
        # job -> per sender of its workers' numbered news, the last number stored: what a
        # re-created supervisor does not take twice (elastic/in_place/supervisor_link.py)
        self._delivered: dict[str, dict[str, int]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._admission: dict[str, asyncio.Lock] = {}
        # Submissions answer before their supervisor starts: the launcher task starts the
        # queued ones in order, one at a time (see _launch_queued).
        self._launches: asyncio.Queue[str] = asyncio.Queue()
        self._to_launch: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        # The nodes' totals for the fit and memory checks, refreshed in the background.
        self.cluster = cluster.ResourceView()
        # One push of the quotas at a time, each reading the store inside it: the last push
        # carries the latest limits, whichever order two admins' changes came in.
        self._quotas_lock = asyncio.Lock()

    # -- commands -----------------------------------------------------------------------

    def check_admissible(self, spec: JobSpec, owner: str) -> JobSpec:
        """The spec as it will run (its data paths made canonical), or a Problem: 422 for
        what can never run, 429 for what must wait until the owner's other jobs end."""
        if spec.is_custom:
            module, _, function = spec.workload.partition(":")
            if any(part.startswith("__") for part in [*module.split("."), function]):
                raise Problem(
                    422,
                    "Invalid job spec",
                    "workload: dunder names (such as __import__) are not entrypoints",
                    errors=[{"field": "workload", "message": "dunder names are not allowed"}],
                )
            allowed = self.settings.entrypoint_modules
            if not any(module == m or module.startswith(m + ".") for m in allowed):
                raise Problem(
                    422,
                    "Invalid job spec",
                    f"workload: module {module!r} is not on this service's "
                    "allow-list of entrypoint modules (ETRAIN_ENTRYPOINT_MODULES)",
                    errors=[{"field": "workload", "message": f"module {module!r} is not allowed"}],
                )
        least = self.settings.min_cpus_per_worker
        if spec.scaling.cpus_per_worker < least:
            message = (
                f"must be at least {least:g} on this service (ETRAIN_MIN_CPUS_PER_WORKER), "
                f"not {spec.scaling.cpus_per_worker:g}"
            )
            raise _invalid("scaling.cpus_per_worker", message, limit="min_cpus_per_worker")
        spec = self._authorize_data_paths(spec, owner)
        refused = self._refused_by_cluster(spec, self.cluster.nodes())
        if refused is not None:
            # The view may predate a node that just joined: refuse only on Ray's answer now.
            refused = self._refused_by_cluster(spec, self.cluster.refresh())
        if refused is not None:
            raise refused
        limits = UserLimits.of(self.settings, self.store.user_limits(owner))
        held = Usage.total(j.spec for j in self.store.active_jobs(owner))
        quotas.check(owner, limits, held, spec)
        return spec

    def _authorize_data_paths(self, spec: JobSpec, owner: str) -> JobSpec:
        wanted = spec.data_paths()
        if not wanted:
            return spec
        access = DataAccess(
            self.settings.data_roots, [*self.settings.private_dirs, *isolation.ray_temp_dirs()]
        )
        try:
            return spec.with_data_paths(access.authorize_all(wanted, owner))
        except PathRefused as e:
            raise _invalid(e.field, e.message, limit="data_roots") from None

    def _refused_by_cluster(self, spec: JobSpec, nodes: cluster.NodeTotals) -> Problem | None:
        """Why a cluster of ``nodes`` (their total resources) could never run the spec: too
        few nodes for min_workers, or no node with a worker's floor of memory."""
        most = launcher.max_workers_ever(spec, nodes)
        if most < spec.scaling.min_workers:
            message = (
                f"min_workers is {spec.scaling.min_workers} but this cluster can hold at "
                f"most {most} workers of {spec.scaling.worker_resources()}"
            )
            return _invalid("scaling.min_workers", message)
        need = memory.estimate(spec)
        if need is None:
            return None
        have = memory.largest_node_memory(spec.scaling.worker_resources(), nodes)
        if have is not None and need.total > have:
            message = (
                f"a worker needs {need.describe()}, more than the "
                f"{have / memory.GIB:.2f} GiB of memory of the largest node that could hold it"
            )
            return Problem(
                422,
                "Job does not fit in memory",
                f"hyperparameters: {message}",
                errors=[{"field": "hyperparameters", "message": message}],
                limit="node_memory",
            )
        return None

    async def submit_once(
        self, spec: JobSpec, owner: str, idempotency_key: str | None
    ) -> tuple[JobRow, bool]:
        """(the job, whether it is a replay): with ``idempotency_key``, a retry with the same
        key and spec gets the job the first submission made, not a second one."""
        if idempotency_key is None:
            return await self.submit(spec, owner), False
        fingerprint = _fingerprint(spec)
        held = await asyncio.to_thread(
            self.store.claim_idempotency_key,
            owner,
            idempotency_key,
            fingerprint,
            IDEMPOTENCY_STALE_S,
        )
        if held is not None:
            if held.fingerprint != fingerprint:
                raise IdempotencyKeyReused(idempotency_key)
            if held.job_id is None:
                raise SubmissionInProgress(idempotency_key)
            return await asyncio.to_thread(self._get, held.job_id), True
        try:
            return await self.submit(spec, owner, idempotency_key), False
        except BaseException:
            await asyncio.to_thread(self.store.release_idempotency_key, owner, idempotency_key)
            raise

    async def submit(self, spec: JobSpec, owner: str, idempotency_key: str | None = None) -> JobRow:
        # One admission at a time per user: two submissions cannot both take the last slot.
        async with self._admission.setdefault(owner, asyncio.Lock()):
            spec = await asyncio.to_thread(self.check_admissible, spec, owner)
            job = await asyncio.to_thread(
                self.store.create_job,
                spec.name,
                owner,
                spec.workload,
                spec.model_dump(mode="json"),
                idempotency_key,
            )
        self._announce("created", job)
        # The job is stored: it is launched even if this process dies now (the pump
        # launches every queued job it finds without a supervisor).
        self.request_launch(job.id)
        return job

    async def cancel(self, job_id: str, reason: str = "cancelled by the user") -> JobRow:
        # Under the job's lock: a launch in progress finishes first, so the cancel either
        # finds its supervisor or leaves nothing for the launcher to start.
        async with self._job_lock(job_id):
            job = await asyncio.to_thread(self._get, job_id)
            if JobState(job.state).is_terminal:
                raise JobAlreadyEnded(job.state)
            handle = self._handles.get(job_id) or await asyncio.to_thread(
                launcher.find_supervisor, job_id, self.settings.ray_namespace
            )
            if handle is None:
                await self._end_without_supervisor(job_id, JobState.CANCELLED, reason)
        if handle is not None:
            try:
                await asyncio.wait_for(handle.cancel.remote(reason), CALL_TIMEOUT_S)
            except launcher.SupervisorGone:
                await self._end_without_supervisor(job_id, JobState.CANCELLED, reason)
            except TimeoutError:
                # It does not answer (busy, or on a node being declared dead): end it anyway,
                # and its attempt with it, so that nothing keeps running for a cancelled job.
                await asyncio.to_thread(
                    launcher.stop_supervisor, handle, job_id, self.settings.ray_namespace
                )
                self._handles.pop(job_id, None)
                await self._end_without_supervisor(job_id, JobState.CANCELLED, reason)
                await self._off_the_schedulers_book(job_id)
        await self.sync(job_id)
        return await asyncio.to_thread(self._get, job_id)

    async def push_quotas(self) -> None:
        """Tell the scheduler every user's quota (workers, GPUs) as the store has them now."""
        async with self._quotas_lock:
            overrides = await asyncio.to_thread(self.store.all_user_limits)
            await queue.push_quotas(
                self.settings.ray_namespace,
                quotas.scheduler_quotas(self.settings, overrides),
                queue.Knobs(
                    dwell_s=self.settings.scheduler_dwell_s,
                    starvation_s=self.settings.scheduler_starvation_s,
                ),
            )

    async def _keep_quotas_pushed(self) -> None:
        while True:
            await asyncio.sleep(QUOTAS_REPUSH_S)
            try:
                await self.push_quotas()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("pushing the quotas to the scheduler failed: %s", e)

    # -- the pump -----------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._run()),
            loop.create_task(self._launch_queued()),
            loop.create_task(self.cluster.keep_fresh()),
            loop.create_task(self._keep_quotas_pushed()),
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
                jobs = await asyncio.to_thread(self.store.active_jobs)
                await asyncio.gather(*(self.sync(j.id) for j in jobs))
                await self._end_overtime(jobs)
                if purged_at is None or time.monotonic() - purged_at > self._purge_every_s():
                    purged_at = time.monotonic()
                    await self._purge_old_data()
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

    async def _end_overtime(self, jobs: list[JobRow]) -> None:
        """Cancel each job running longer than its owner's max_wall_time_s."""
        running = [j for j in jobs if j.started_at is not None]
        if not running:
            return
        overrides = await asyncio.to_thread(self.store.all_user_limits)
        now = datetime.now(UTC)
        for job in running:
            limit = UserLimits.of(self.settings, overrides.get(job.owner)).max_wall_time_s
            started = _aware(job.started_at)  # type: ignore[arg-type]
            ran = (now - started).total_seconds()
            if limit is None or ran <= limit:
                continue
            reason = (
                f"wall-time limit: the job ran {ran:.0f} s, over {job.owner}'s "
                f"max_wall_time_s of {limit:g} s"
            )
            with contextlib.suppress(JobAlreadyEnded):  # it ended meanwhile
                await self.cancel(job.id, reason)

    def _purge_every_s(self) -> float:
        # A tenth of the retention period, so that nothing is kept much longer than it says.
        return min(PURGE_EVERY_S, self.settings.retention_days * 86400 / 10)

    async def _purge_old_data(self) -> None:
        days = self.settings.retention_days
        if days <= 0:
            return
        before = datetime.now(UTC) - timedelta(days=days)
        gone = await asyncio.to_thread(self.store.purge_finished, before)
        if gone:
            log.info(
                "retention: deleted %d metric and log rows of jobs ended before %s", gone, before
            )

    async def sync(self, job_id: str) -> None:
        """Bring the store up to date with the job's supervisor."""
        async with self._job_lock(job_id):
            job = await asyncio.to_thread(self._get, job_id)
            if JobState(job.state).is_terminal:
                self._forget(job_id)
                return
            handle = self._handles.get(job_id)
            if handle is None:
                handle = await asyncio.to_thread(
                    launcher.find_supervisor, job_id, self.settings.ray_namespace
                )
                if handle is None:
                    await self._supervisor_missing(job)
                    return
                # A service killed right after a launch can take the supervisor's `start`
                # call with it (the call waits in the killed process until the actor is up):
                # the supervisor would sit idle forever. Starting is idempotent: ask again.
                handle.start.remote()
            self._handles[job_id] = handle
            self._missing_since.pop(job_id, None)
            try:
                events = await asyncio.wait_for(handle.events.remote(job.last_seq), CALL_TIMEOUT_S)
            except launcher.SupervisorGone as e:
                self._handles.pop(job_id, None)
                await self._recreate_or_fail(job, f"the job's supervisor died: {e}")
                return
            except TimeoutError:
                return  # busy or on a node being declared dead: try next tick
            if not events:
                return
            job = await self._store_events(job_id, events)
            handle.ack.remote(events[-1]["seq"])
            if JobState(job.state).is_terminal:
                # A GCS call: on the event loop it held every request while it ran.
                await asyncio.to_thread(
                    launcher.stop_supervisor, handle, job_id, self.settings.ray_namespace
                )
                self._forget(job_id)
                await self._off_the_schedulers_book(job_id)

    async def _off_the_schedulers_book(self, job_id: str) -> None:
        """The ended job's workers are free for the next job now, not at the scheduler's next
        check (see jobs.queue.forget)."""
        try:
            await queue.forget(self.settings.ray_namespace, job_id)
        except Exception as e:  # it finds the stopped supervisor gone by itself anyway
            log.warning("telling the scheduler that %s ended failed: %s", job_id, e)

    def _job_lock(self, job_id: str) -> asyncio.Lock:
        return self._locks.setdefault(job_id, asyncio.Lock())

    def request_launch(self, job_id: str) -> None:
        """Start the stored, queued job's supervisor in the background (once, however often
        asked); a launch that fails fails the job, with the reason in its event log."""
        if job_id not in self._to_launch:
            self._to_launch.add(job_id)
            self._launches.put_nowait(job_id)

    async def _launch_queued(self) -> None:
        """Start the supervisors of submitted jobs, oldest first, one at a time, each waited
        for until it answers. Starting one is a new Ray worker process: a burst of
        submissions started all at once took every core of a small head node from the API
        (bench/api_load.py), and a job cancelled while it waits here is never started."""
        while True:
            job_id = await self._launches.get()
            try:
                async with self._job_lock(job_id):
                    self._to_launch.discard(job_id)
                    job = await asyncio.to_thread(self.store.get_job, job_id)
                    if job is None or job.state != JobState.QUEUED.value:
                        continue  # cancelled (or launched by a pump tick) meanwhile
                    if self._handles.get(job_id) is not None:
                        continue
                    handle = await self._launch(job)
                if handle is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            handle.__ray_ready__.remote(), LAUNCH_READY_TIMEOUT_S
                        )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("launching %s failed", job_id)

    async def _launch(self, job: JobRow, resume: launcher.Resume | None = None) -> Any | None:
        """The new supervisor's handle; None when it could not be started, and then the job
        has failed with the reason in its event log."""
        try:
            spec = JobSpec.model_validate(job.spec)
            handle = await asyncio.to_thread(
                launcher.launch,
                job.id,
                spec,
                self.settings.resolved_checkpoint_dir,
                self.settings.ray_namespace,
                job.last_seq + 1,
                resume,
                job.owner,
                job.created_at.timestamp(),
            )
            self._handles[job.id] = handle
            return handle
        except Exception as e:
            log.exception("could not launch %s", job.id)
            await self._end_without_supervisor(
                job.id, JobState.FAILED, f"could not start the job on Ray: {e}"
            )
            return None

    async def _supervisor_missing(self, job: JobRow) -> None:
        if job.state == JobState.QUEUED.value and job.started_at is None:
            # Submitted, not launched yet: waiting for the launcher, or stored by a process
            # that stopped before it launched it. (A job that ran and was preempted back to
            # the queue had a supervisor: it is re-created like a running job's.)
            self.request_launch(job.id)
            return
        first = self._missing_since.setdefault(job.id, time.monotonic())
        if time.monotonic() - first < MISSING_GRACE_S:
            return
        await self._recreate_or_fail(
            job, "the job's supervisor is gone from Ray (the cluster restarted or lost its node)"
        )

    async def _recreate_or_fail(self, job: JobRow, why: str) -> None:
        """A job whose supervisor died goes on under a new one, from its latest checkpoint,
        or from step 0 when it saved none (the new supervisor says which in an event); one
        re-created MAX_RECREATIONS times already fails with ``why``."""
        times = self._recreated.get(job.id, 0)
        if times >= MAX_RECREATIONS:
            why = f"{why}; it was re-created {times} times already"
            await self._end_without_supervisor(job.id, JobState.FAILED, why)
            return
        self._recreated[job.id] = times + 1
        self._missing_since.pop(job.id, None)
        # The new supervisor finds the latest valid checkpoint (or none) and says which.
        log.warning("%s: %s; re-creating its supervisor", job.id, why)
        resume = launcher.Resume(
            job.state, job.step or 0, job.world_size or 0, dict(self._delivered.get(job.id, {}))
        )
        await self._launch(job, resume)

    async def _end_without_supervisor(self, job_id: str, state: JobState, reason: str) -> None:
        """Only when no supervisor can write the log any more does the service write it."""
        job = await asyncio.to_thread(self._get, job_id)
        if JobState(job.state).is_terminal:
            return
        event = {
            "seq": job.last_seq + 1,
            "kind": EventKind.STATE,
            "time": time.time(),
            "data": {"state": state.value, "previous": job.state, "reason": reason},
        }
        await self._store_events(job_id, [event])
        self._forget(job_id)
        try:
            await asyncio.to_thread(
                launcher.end_attempt_leftovers, job_id, self.settings.ray_namespace
            )
        except Exception as e:  # Ray unreachable: what is left of the job dies with it
            log.warning("ending what is left of %s's attempt failed: %s", job_id, e)

    async def _store_events(self, job_id: str, events: list[dict[str, Any]]) -> JobRow:
        """Store, then tell live streams: nothing is sent that is not stored first."""
        delivered = self._delivered.setdefault(job_id, {})
        for event in events:
            origin = event.pop("origin", None)  # the worker's numbered news it records
            if origin is not None:
                sender, n = origin
                delivered[sender] = max(delivered.get(sender, -1), int(n))
        events = with_relative_paths(job_id, events)
        job = await asyncio.to_thread(self.store.append_events, job_id, events)
        self.hub.publish(job_id, events)
        for kind in dict.fromkeys(e["kind"] for e in events if e["kind"] in ANNOUNCED):
            self._announce(kind, job)
        return job

    def _announce(self, kind: str, job: JobRow) -> None:
        self.hub.publish_all(
            {"type": kind, "job": JobOut.model_validate(job).model_dump(mode="json")}
        )

    def _forget(self, job_id: str) -> None:
        self._handles.pop(job_id, None)
        self._missing_since.pop(job_id, None)
        self._recreated.pop(job_id, None)
        self._delivered.pop(job_id, None)

    def _get(self, job_id: str) -> JobRow:
        job = self.store.get_job(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job


def _fingerprint(spec: JobSpec) -> str:
    return hashlib.sha256(
        json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()
    ).hexdigest()


def _invalid(field: str, message: str, **extensions: Any) -> Problem:
    return Problem(
        422,
        "Invalid job spec",
        f"{field}: {message}",
        errors=[{"field": field, "message": message}],
        **extensions,
    )


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
