"""What the live Ray cluster holds and has free, node by node (only live nodes count), as
one watcher per cluster sees it, and reservations of capacity for one job.

The supervisor sees the cluster only through :class:`CapacitySource`, so that its loop runs
in unit tests against a fake one.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray._private import state as ray_state
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from elastic import warm_processes
from elastic.cluster.books import SchedulerBook
from elastic.cluster.reservation import Reservation
from elastic.cluster.scheduling import Demand, Knobs, Placement, workers_that_fit
from elastic.warm_processes import HEAD_RESOURCE, SCHEDULER_NAME

log = logging.getLogger(__name__)

WATCH_POLL_S = 0.5
# How often the scheduler checks that the supervisors it books workers for still live (one
# killed with its node never says goodbye), and plans again with fresh throughput.
SCHEDULER_CHECK_S = 5.0
# A supervisor's wait for news is cut off after this, so that it can look at its own clock.
WAIT_CAP_S = 2.0
# Capacity handed from a reservation to a worker group that Ray Train places itself stays
# out of other jobs' sight until the group is placed, or at most this long.
CLAIM_TTL_S = 120.0

Resources = dict[str, dict[str, float]]


@dataclass(frozen=True)
class Snapshot:
    """The cluster at one moment: which nodes are alive, and what each has free."""

    version: int
    alive: frozenset[str]
    free: dict[str, dict[str, float]] = field(default_factory=dict)
    # Nodes Ray is draining (a preemption notice, a scale-down) -> the deadline, Unix ms (0:
    # none). They are alive but take no new work, and will go.
    draining: dict[str, int] = field(default_factory=dict)
    # The cluster scheduler's decision for the asking job: the size it should have and why
    # (None: the job did not register with a scheduler, and sizes itself by what is free).
    target: Placement | None = None

    def workers_free(self, per_worker: Mapping[str, float], exclude: Collection[str] = ()) -> int:
        """Workers that fit in what is free, leaving out ``exclude`` (nodes suspected dead
        that Ray's membership has not caught up with yet) and draining nodes."""
        free = [
            r
            for node, r in self.free.items()
            if node in self.alive and node not in exclude and node not in self.draining
        ]
        return workers_that_fit(free, per_worker)


@dataclass(frozen=True)
class RowDecision:
    """The scheduler's word on a queued job the service holds as a row."""

    target: Placement | None  # None until the scheduler has planned with it
    supervised: bool  # its supervisor has taken it over (launched, and asking itself)

    @property
    def starts(self) -> bool:
        return not self.supervised and self.target is not None and self.target.size > 0


class CapacitySource(Protocol):
    async def snapshot(self, after_version: int = -1, timeout_s: float = 0.0) -> Snapshot:
        """The current snapshot, or, given ``after_version``, the first newer one (waiting
        at most ``timeout_s``; the current one when nothing changed)."""
        ...

    async def reserve(
        self, workers: int, per_worker: Mapping[str, float], timeout_s: float
    ) -> Reservation | None:
        """Hold ``workers`` workers' resources for this job, or None if they cannot be had
        within ``timeout_s`` (another job took them)."""
        ...

    async def release(self, reservation: Reservation, hand_over: bool) -> None:
        """Give the capacity back; with ``hand_over``, to this job's next worker group, which
        places itself: until :meth:`settle`, other jobs do not count it as free."""
        ...

    async def settle(self) -> None:
        """This job's worker group is placed: what was handed over is its own now."""
        ...

    async def unreachable(self, nodes: Collection[str], timeout_s: float) -> set[str]:
        """Those of ``nodes`` that do not answer within ``timeout_s``: a node killed a moment
        ago is still alive in Ray's membership for seconds, while its workers' peers have
        already failed."""
        ...

    async def register(self, demand: Demand) -> None:
        """Ask the cluster's scheduler for workers: from now on every snapshot carries its
        decision for this job (:attr:`Snapshot.target`)."""
        ...

    async def unregister(self) -> None:
        """The job holds nothing any more: the scheduler hands its workers to others."""
        ...

    async def observe(self, world_size: int, samples_per_s: float) -> None:
        """The job's measured throughput at this size, for the scheduler's sharing."""
        ...


# -- Ray -------------------------------------------------------------------------------------


def free_per_node() -> dict[str, dict[str, float]]:
    return dict(ray_state.available_resources_per_node())


def total_per_node() -> dict[str, dict[str, float]]:
    return dict(ray_state.total_resources_per_node())


def actor_alive(actor_id: str) -> bool:
    """Whether the actor lives or will again (restarting); an unknown actor is not alive."""
    info = ray_state.actors(actor_id=actor_id)
    return bool(info) and info.get("State") not in ("DEAD", None)


def remove_orphaned_groups(namespace: str) -> list[str]:
    """Remove this namespace's placement groups whose creating actor is dead while its Ray
    job lives. GCS keeps such a group until the job ends (the API process: days), and one is
    left whenever an attempt is stopped while Ray Train still places its worker group (Ray
    Train hands the group to its own cleaner only once the group started): the nodes would
    stay held for nobody. Returns the removed groups' ids."""
    from ray.core.generated import gcs_pb2

    table_data: Any = gcs_pb2.PlacementGroupTableData  # type: ignore[attr-defined]
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    removed = []
    for raw in ray_state.state._connect_and_get_accessor().get_placement_group_table():
        group = table_data.FromString(raw)
        if (
            group.ray_namespace == namespace
            and group.creator_actor_dead
            and not group.creator_job_dead
            and not group.is_detached
            and group.state != table_data.REMOVED
            and not ray.ActorID(group.creator_actor_id).is_nil()
        ):
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(group.placement_group_id)))
            removed.append(group.placement_group_id.hex())
    return removed


def draining_nodes() -> dict[str, int]:
    return dict(ray_state.state.get_draining_nodes())


def alive_nodes() -> set[str]:
    return {str(n["NodeID"]) for n in ray.nodes() if n.get("Alive")}


def head_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and HEAD_RESOURCE in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


def on_head_node() -> dict[str, Any]:
    """Actor options that pin it to the head node, which outlives the worker nodes that may
    vanish. Hard affinity: a soft one let Ray place actors on workers when the head has no
    CPUs. Empty when no head can be found (a client connection to an odd cluster)."""
    head = head_node_id()
    if head is None:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(head, soft=False)}


@ray.remote(num_cpus=0)
class MembershipWatcher:
    """One per cluster (a named actor that every supervisor shares): it alone asks Ray for
    the nodes and their free resources, and wakes the supervisors waiting for a change."""

    def __init__(self) -> None:
        # Ray's imports live as long as this actor: out of the collector's sight, a full
        # collection scans only what the books made, and answers do not wait 60 ms for it.
        gc.collect()
        gc.freeze()
        self.current = Snapshot(0, frozenset(), {})
        self.changed = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        # job -> (per node, until, the claiming supervisor's actor id)
        self.claims: dict[str, tuple[Resources, float, str | None]] = {}
        self.book = SchedulerBook()
        self.totals: Resources = {}
        self.supervisors: dict[str, str] = {}  # job -> its supervisor's actor id
        self.checked_at = 0.0
        # checkpoint directory -> the live nodes that showed they share it (see
        # elastic.checkpoint.storage.unshared_checkpoint_dir)
        self.sharing: dict[str, set[str]] = {}
        # Processes each node keeps ready to train (elastic/warm_processes.py); 0 until the
        # service says (``keep_warm``).
        self.warm_per_node = 0
        self.warmed: set[str] = set()  # nodes owed their pools: not owed them again
        self.refills = warm_processes.Refills()

    async def keep_warm(self, per_node: int) -> None:
        """Keep ``per_node`` processes ready on each node: the nodes seen from now on, and
        those alive now whose pools were never filled."""
        self.warm_per_node = per_node
        await self._ensure_watching()
        await self._warm(self.current.alive)

    async def replace_taken(self, node_id: str, kind: str) -> None:
        """An actor took a process from ``node_id``'s ``kind`` pool: owe the pool another
        (started by :meth:`_refill`)."""
        if self.warm_per_node <= 0:  # the pools are off: nothing to keep filled
            return
        due = time.monotonic() + warm_processes.REPLACE_AFTER_S
        self.refills.owe(node_id, warm_processes.Kind(kind), 1, due)

    async def _warm(self, nodes: frozenset[str]) -> None:
        new_nodes = nodes - self.warmed
        if self.warm_per_node <= 0 or not new_nodes:
            return
        namespace = ray.get_runtime_context().namespace
        per_node = self.warm_per_node
        try:
            owed = await asyncio.to_thread(
                lambda: warm_processes.first_seen(
                    [n for n in ray.nodes() if str(n["NodeID"]) in new_nodes], per_node, namespace
                )
            )
        except Exception:
            log.exception("filling the nodes' pools of ready processes failed")
            return
        due = time.monotonic() + warm_processes.REPLACE_AFTER_S
        for node, sizes in owed.items():
            for kind, count in sizes.items():
                self.refills.owe(node, kind, count, due)
        self.warmed |= new_nodes

    async def _refill(self) -> None:
        """Start the owed processes that may start now (:class:`warm_processes.Refills`)."""
        if self.warm_per_node <= 0:  # the pools are off: nothing is owed, nothing to watch
            return
        free_cpus = {node: r.get("CPU", 0.0) for node, r in self.current.free.items()}
        for per_node, _, _ in self.claims.values():
            for node, held in per_node.items():
                if node in free_cpus:
                    free_cpus[node] -= held.get("CPU", 0.0)
        now = time.monotonic()
        starts = self.refills.take_due(now, self.current.alive, free_cpus)
        if not starts:
            return
        log.info(
            "starting ready processes: %s", {f"{n} {k.value}": c for (n, k), c in starts.items()}
        )
        try:
            failed = await asyncio.to_thread(lambda: warm_processes.start(ray.nodes(), starts))
        except Exception:
            log.exception("could not read the nodes to start ready processes on")
            failed = dict(starts)
        for (node, kind), count in failed.items():
            self.refills.owe(node, kind, count, now + warm_processes.RETRY_AFTER_S)

    async def claim(self, job_id: str, per_node: Resources, owner: str | None = None) -> None:
        self.claims[job_id] = (per_node, time.monotonic() + CLAIM_TTL_S, owner)
        self._bump()

    async def unclaim(self, job_id: str) -> None:
        if self.claims.pop(job_id, None) is not None:
            self._bump()

    async def snapshot(self, job_id: str, after_version: int, timeout_s: float) -> Snapshot:
        """As :meth:`CapacitySource.snapshot`, less what other jobs have claimed."""
        current = await self._wait(after_version, timeout_s)
        now = time.monotonic()
        self.claims = {j: c for j, c in self.claims.items() if c[1] > now}
        free = {node: dict(r) for node, r in current.free.items()}
        for other, (per_node, _, _) in self.claims.items():
            if other == job_id:
                continue
            for node, held in per_node.items():
                for name, amount in held.items():
                    if node in free:
                        free[node][name] = max(0.0, free[node].get(name, 0.0) - amount)
        target = self.book.target(job_id)
        return Snapshot(current.version, current.alive, free, current.draining, target)

    async def nodes_sharing(self, root: str) -> frozenset[str]:
        return frozenset(self.sharing.get(root, ()))

    async def record_sharing(self, root: str, nodes: list[str]) -> None:
        await self._ensure_watching()  # it forgets the nodes that die
        alive = self.current.alive
        self.sharing.setdefault(root, set()).update(n for n in nodes if n in alive)

    async def _ensure_watching(self) -> None:
        if self.task is None or self.task.done():
            if self.task is None:
                await self._poll()
            self.task = asyncio.get_running_loop().create_task(self._watch())

    async def _wait(self, after_version: int, timeout_s: float) -> Snapshot:
        await self._ensure_watching()
        deadline = time.monotonic() + min(timeout_s, WAIT_CAP_S)
        while self.current.version <= after_version:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            changed = self.changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                break
        return self.current

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_POLL_S)
            try:
                await self._poll()
            except Exception:
                # One failed look (a GCS call timing out on a loaded head) must not freeze
                # the snapshot for every job for the rest of the cluster's life: drains and
                # free capacity would never be seen again.
                log.exception("the membership poll failed; polling on")

    async def _poll(self) -> None:
        await asyncio.to_thread(remove_orphaned_groups, ray.get_runtime_context().namespace)
        alive, free, draining, totals = await asyncio.to_thread(
            lambda: (alive_nodes(), free_per_node(), draining_nodes(), total_per_node())
        )
        await self._drop_orphan_claims()
        await self._check_supervisors()
        await self._refill()
        c = self.current
        if alive == c.alive and free == c.free and draining == c.draining:
            return
        self.current = Snapshot(c.version + 1, frozenset(alive), free, draining)
        if alive != c.alive:
            await self._warm(frozenset(alive - c.alive))
            self.sharing = {
                root: live for root, nodes in self.sharing.items() if (live := nodes & alive)
            }
        if totals != self.totals or alive != c.alive or draining != c.draining:
            self.totals = totals
            self._replan()
        self._bump(new=False)

    async def _drop_orphan_claims(self) -> None:
        """A supervisor killed (a cancel, a lost node) between handing capacity over and
        settling it leaves its claim behind: without this, other jobs would not see that
        capacity as free until the claim's TTL ran out."""
        owners = {job: c[2] for job, c in self.claims.items() if c[2] is not None}
        if not owners:
            return
        dead = await asyncio.to_thread(
            lambda: {job for job, owner in owners.items() if not actor_alive(owner)}
        )
        for job in dead:
            self.claims.pop(job, None)
        if dead:
            self._bump()

    # -- the scheduler ------------------------------------------------------------------------

    async def register(self, demand: Demand, supervisor: str | None) -> None:
        await self._ensure_watching()  # its first decision needs the nodes
        log.info("scheduler: %s registers", demand.job_id)
        self.book.register(demand, time.time())
        if supervisor is not None:
            self.supervisors[demand.job_id] = supervisor
        self._replan(force=True)

    async def hold_rows(self, demands: list[Demand]) -> tuple[int, dict[str, RowDecision]]:
        """The service's queued jobs that have no supervisor (every one: see
        ``SchedulerBook.hold_rows``), and the books' version with each row's decision: a
        row told to start gets its supervisor from the service, which says why the others
        wait."""
        await self._ensure_watching()
        if self.book.hold_rows(demands, time.time()):
            self._replan(force=True)
        return self.current.version, {
            d.job_id: RowDecision(self.book.target(d.job_id), self.book.supervised(d.job_id))
            for d in demands
        }

    async def news_after(self, after_version: int, timeout_s: float) -> int:
        """The version of the first change after ``after_version``, waiting at most
        ``timeout_s`` (the current one when nothing changed): what the service's rows wait
        on between bookings."""
        return (await self._wait(after_version, timeout_s)).version

    async def unregister(self, job_id: str) -> None:
        log.info("scheduler: %s unregisters", job_id)
        self.supervisors.pop(job_id, None)
        if self.book.unregister(job_id):
            self._replan(force=True)

    async def observe(self, job_id: str, world_size: int, samples_per_s: float) -> None:
        self.book.observe(job_id, world_size, samples_per_s)

    async def set_quotas(
        self, quotas: dict[str, dict[str, float | None]], knobs: Knobs | None = None
    ) -> None:
        """Owner -> {"workers": n or None, "gpus": n or None}: the service pushes every
        user's quota at start-up and on each change; "*" is the quota of an owner not named
        (none, when "*" is not given either). A new watcher has none until the service's
        next push (within 30 s)."""
        self.book.set_quotas(quotas)
        if knobs is not None:
            self.book.knobs = knobs
        self._replan(force=True)

    async def queue(self, after_position: int = 0, limit: int | None = None) -> dict[str, Any]:
        """What the scheduler holds, for ``GET /v1/queue`` and the dashboard:

        ``{"queue": [{"job_id", "owner", "priority", "position", "reason",
        "expected_start_s"}], "waiting": n, "running": [{"job_id", "owner", "priority",
        "size", "borrowed", "min_workers", "max_workers"}], "quotas": {owner: {"workers",
        "gpus"}}}`` (positions from 1, in the order the waiting jobs would start; ``queue``
        holds those after ``after_position``, at most ``limit``; ``waiting`` counts all)."""
        return self.book.view(after_position, limit)

    def _replan(self, force: bool = False) -> None:
        """Decide every job's size again; wake the supervisors when a decision changed (a
        bump even with none, when ``force``: a job that just registered waits for its
        first decision)."""
        c = self.current
        nodes = [
            total
            for node, total in self.totals.items()
            if node in c.alive and node not in c.draining
        ]
        if self.book.replan(nodes, time.time()) or force:
            self._bump()

    async def _check_supervisors(self) -> None:
        """Forget the jobs whose supervisor died without saying so (killed with its node, or
        by a cancel): their workers went with it, and others may have them."""
        now = time.monotonic()
        if now - self.checked_at < SCHEDULER_CHECK_S:
            return
        self.checked_at = now
        owners = dict(self.supervisors)
        if owners:
            dead = await asyncio.to_thread(
                lambda: {job for job, actor in owners.items() if not actor_alive(actor)}
            )
            for job in dead:
                log.warning("scheduler: the supervisor of %s is gone; its workers are free", job)
                self.supervisors.pop(job, None)
                self.book.unregister(job)
        self._replan()  # with fresh throughput, at most this often: sizes do not flap

    def _bump(self, new: bool = True) -> None:
        if new:
            c = self.current
            self.current = Snapshot(c.version + 1, c.alive, c.free, c.draining)
        self.changed.set()
        self.changed = asyncio.Event()


def one_per_cluster(name: str, namespace: str) -> dict[str, Any]:
    """Actor options for the cluster's one actor named ``name``: detached, on the head node,
    and the running one if there is one."""
    return {
        "name": name,
        "namespace": namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        **on_head_node(),
    }


def shared_watcher(namespace: str) -> Any:
    """The cluster's one membership watcher and scheduler, started if it is not running."""
    options = one_per_cluster(SCHEDULER_NAME, namespace)
    return MembershipWatcher.options(**options).remote()  # type: ignore[attr-defined]


class RayCapacity:
    """The cluster through the shared watcher; reservations are placement groups."""

    def __init__(self, namespace: str, job_id: str) -> None:
        self.namespace = namespace
        self.job_id = job_id
        self._watcher: Any = None
        self.demand: Demand | None = None  # registered with the scheduler

    def _get_watcher(self) -> Any:
        if self._watcher is None:
            self._watcher = shared_watcher(self.namespace)
        return self._watcher

    async def _call(self, method: str, *args: Any) -> Any:
        """Call the shared watcher; if it died (killed by hand, its node lost), start a new
        one and call that: a job must not fail because the watcher went."""
        for tries_left in (1, 0):
            try:
                return await getattr(self._get_watcher(), method).remote(*args)
            except ray.exceptions.RayActorError:
                self._watcher = None
                if not tries_left:
                    raise
        raise AssertionError("unreachable")

    async def snapshot(self, after_version: int = -1, timeout_s: float = 0.0) -> Snapshot:
        snap: Snapshot = await self._call("snapshot", self.job_id, after_version, timeout_s)
        if snap.target is None and self.demand is not None:
            # A new watcher (the old one died) has empty books: ask it again.
            await self.register(self.demand)
            snap = await self._call("snapshot", self.job_id, -1, 0.0)
        return snap

    async def reserve(
        self, workers: int, per_worker: Mapping[str, float], timeout_s: float
    ) -> Reservation | None:
        from ray.util.placement_group import placement_group, remove_placement_group

        group = placement_group([dict(per_worker)] * workers, strategy="PACK")
        ready, _ = await asyncio.to_thread(ray.wait, [group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(group)
            return None
        return Reservation(workers, group)

    async def release(self, reservation: Reservation, hand_over: bool) -> None:
        from ray.util.placement_group import placement_group_table, remove_placement_group

        group = reservation.handle
        if hand_over:
            table = await asyncio.to_thread(placement_group_table, group)
            per_node: Resources = {}
            for index, node in table.get("bundles_to_node_id", {}).items():
                held = per_node.setdefault(str(node), {})
                for name, amount in table["bundles"][index].items():
                    held[name] = held.get(name, 0.0) + float(amount)
            owner = ray.get_runtime_context().get_actor_id()
            await self._call("claim", self.job_id, per_node, owner)
        await asyncio.to_thread(remove_placement_group, group)

    async def settle(self) -> None:
        await self._call("unclaim", self.job_id)

    async def register(self, demand: Demand) -> None:
        self.demand = demand
        await self._call("register", demand, ray.get_runtime_context().get_actor_id())

    async def unregister(self) -> None:
        self.demand = None
        await self._call("unregister", self.job_id)

    async def observe(self, world_size: int, samples_per_s: float) -> None:
        await self._call("observe", self.job_id, world_size, samples_per_s)

    async def nodes_sharing(self, root: str) -> frozenset[str]:
        known: frozenset[str] = await self._call("nodes_sharing", root)
        return known

    async def record_sharing(self, root: str, nodes: list[str]) -> None:
        await self._call("record_sharing", root, nodes)

    async def unreachable(self, nodes: Collection[str], timeout_s: float) -> set[str]:
        probes = {
            node: _answer.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
            ).remote()
            for node in nodes
        }
        if not probes:
            return set()
        ready, _ = await asyncio.to_thread(
            ray.wait, list(probes.values()), num_returns=len(probes), timeout=timeout_s
        )
        silent = set()
        for node, probe in probes.items():
            if probe not in ready:
                silent.add(node)
                ray.cancel(probe, force=True)
                continue
            try:
                await probe
            except ray.exceptions.RayError:  # the node was declared dead meanwhile
                silent.add(node)
        return silent


@ray.remote(num_cpus=0, max_retries=0)
def _answer() -> None:
    return None
