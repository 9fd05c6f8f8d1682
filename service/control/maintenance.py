"""What the control does on a clock rather than on a request: the jobs over their owner's
wall-time limit, retention of finished jobs' metrics and logs, and the quotas pushed to the
cluster's scheduler (one re-created after its death starts with none)."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

from jobs import queue
from service import quotas
from service.quotas import UserLimits
from service.settings import Settings
from service.store import JobRow, Store

log = logging.getLogger(__name__)

# How often finished jobs' old metrics and logs are deleted (ETRAIN_RETENTION_DAYS).
PURGE_EVERY_S = 600.0
# How often the quotas are pushed to the scheduler again although none changed.
QUOTAS_REPUSH_S = 30.0


class Maintenance:
    def __init__(self, settings: Settings, store: Store) -> None:
        self.settings, self.store = settings, store
        # One push of the quotas at a time, each reading the store inside it: the last push
        # carries the latest limits, whichever order two admins' changes came in.
        self._quotas_lock = asyncio.Lock()

    async def overtime(self, jobs: list[JobRow]) -> list[tuple[str, str]]:
        """(job, why) for each job running longer than its owner's max_wall_time_s."""
        running = [j for j in jobs if j.started_at is not None]
        if not running:
            return []
        overrides = await asyncio.to_thread(self.store.all_user_limits)
        now = datetime.now(UTC)
        over = []
        for job in running:
            limit = UserLimits.of(self.settings, overrides.get(job.owner)).max_wall_time_s
            started = _aware(job.started_at)  # type: ignore[arg-type]
            ran = (now - started).total_seconds()
            if limit is None or ran <= limit:
                continue
            over.append(
                (
                    job.id,
                    f"wall-time limit: the job ran {ran:.0f} s, over {job.owner}'s "
                    f"max_wall_time_s of {limit:g} s",
                )
            )
        return over

    def purge_every_s(self) -> float:
        # A tenth of the retention period, so that nothing is kept much longer than it says.
        return min(PURGE_EVERY_S, self.settings.retention_days * 86400 / 10)

    async def purge_old_data(self) -> None:
        days = self.settings.retention_days
        if days <= 0:
            return
        before = datetime.now(UTC) - timedelta(days=days)
        gone = await asyncio.to_thread(self.store.purge_finished, before)
        if gone:
            log.info(
                "retention: deleted %d metric and log rows of jobs ended before %s", gone, before
            )

    async def push_quotas(self) -> None:
        """Tell the scheduler every user's quota (workers, GPUs) as the store has them now, and
        how many processes each node keeps ready to train."""
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
            await queue.keep_warm(
                self.settings.ray_namespace, self.settings.warm_processes_per_node
            )

    async def keep_quotas_pushed(self) -> None:
        while True:
            await asyncio.sleep(QUOTAS_REPUSH_S)
            try:
                await self.push_quotas()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("pushing the quotas to the scheduler failed: %s", e)


def _aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
