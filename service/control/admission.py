"""Admission: whether a job spec may run on this service and this cluster, as it will run
(its data paths made canonical). What can never run is a :class:`SpecRefused`; what must
wait until the owner's other jobs end is refused by the quotas."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from elastic.checkpoint.storage import is_object_uri
from jobs import cluster, entrypoints, isolation, launcher, memory
from jobs.code_store import CodeStore
from jobs.spec import JobSpec
from jobs.workloads.data_paths import DataAccess, PathRefused
from service import quotas
from service.errors import SpecRefused
from service.quotas import Usage, UserLimits
from service.settings import Settings
from service.store import Store


class Admission:
    def __init__(self, settings: Settings, store: Store, view: cluster.ResourceView) -> None:
        self.settings, self.store, self.view = settings, store, view

    def check(self, spec: JobSpec, owner: str) -> JobSpec:
        if spec.is_custom:
            self._check_entrypoint(spec.workload)
        least = self.settings.min_cpus_per_worker
        if spec.scaling.cpus_per_worker < least:
            raise SpecRefused(
                "scaling.cpus_per_worker",
                f"must be at least {least:g} on this service (ETRAIN_MIN_CPUS_PER_WORKER), "
                f"not {spec.scaling.cpus_per_worker:g}",
                limit="min_cpus_per_worker",
            )
        spec = self._authorize_data_paths(spec, owner)
        limits = UserLimits.of(self.settings, self.store.user_limits(owner))
        if spec.runs_user_code:
            quotas.check_code_allowed(owner, limits)
            self._check_code(spec, owner)
        refused = refused_by_cluster(spec, self.view.nodes())
        if refused is not None:
            # The view may predate a node that just joined: refuse only on Ray's answer now.
            refused = refused_by_cluster(spec, self.view.refresh())
        if refused is not None:
            raise refused
        held = Usage.total(j.spec for j in self.store.active_jobs(owner))
        quotas.check(owner, limits, held, spec)
        return spec

    def _check_entrypoint(self, workload: str) -> None:
        module, _, function = workload.partition(":")
        if any(part.startswith("__") for part in [*module.split("."), function]):
            raise SpecRefused(
                "workload",
                "dunder names are not allowed",
                detail="dunder names (such as __import__) are not entrypoints",
            )
        allowed = self.settings.entrypoint_modules
        if not any(module == m or module.startswith(m + ".") for m in allowed):
            raise SpecRefused(
                "workload",
                f"module {module!r} is not allowed",
                detail=f"module {module!r} is not on this service's "
                "allow-list of entrypoint modules (ETRAIN_ENTRYPOINT_MODULES)",
            )
        why_not = entrypoints.problem(workload, sys.path)
        if why_not is not None:
            raise SpecRefused("workload", why_not)

    def _check_code(self, spec: JobSpec, owner: str) -> None:
        """The package a command job names is one of its owner's (another's is unknown)."""
        if spec.code is None:
            return
        if spec.runs_package_loop and is_object_uri(self.settings.resolved_checkpoint_dir):
            # The loop's context writes its checkpoints from the confined child, which is
            # given none of the store's credentials (docs/security.md).
            raise SpecRefused(
                "code",
                "a package's loop cannot save its checkpoints here: it runs in a confined "
                "process that holds no credentials for this service's checkpoint bucket "
                f"({self.settings.resolved_checkpoint_dir}); run the script as a command "
                "job, or use a service whose ETRAIN_CHECKPOINT_DIR is a shared filesystem",
            )
        store = CodeStore(self.settings.resolved_checkpoint_dir)
        if not store.exists(owner, spec.code):
            raise SpecRefused(
                "code",
                f"no code package {spec.code} of yours: upload it first (POST /v1/code, "
                "or etrain submit --code DIR)",
            )
        location = store.location(owner, spec.code)
        if spec.runs_package_loop and not is_object_uri(location):
            why_not = entrypoints.problem_in_package(spec.workload, Path(location))
            if why_not is not None:
                raise SpecRefused("workload", why_not)

    def _authorize_data_paths(self, spec: JobSpec, owner: str) -> JobSpec:
        wanted = spec.data_paths()
        if not wanted:
            return spec
        access = data_access(self.settings)
        try:
            return spec.with_data_paths(access.authorize_all(wanted, owner))
        except PathRefused as e:
            raise SpecRefused(e.field, e.message, limit="data_roots") from None


def data_access(settings: Settings) -> DataAccess:
    """What jobs may read: the data roots, never the service's files nor Ray's."""
    return DataAccess(settings.data_roots, [*settings.private_dirs, *isolation.ray_temp_dirs()])


def refused_by_cluster(spec: JobSpec, nodes: cluster.NodeTotals) -> SpecRefused | None:
    """Why a cluster of ``nodes`` (their total resources) could never run the spec: too few
    nodes for min_workers, or no node with a worker's floor of memory."""
    most = launcher.max_workers_ever(spec, nodes)
    if most < spec.scaling.min_workers:
        return SpecRefused(
            "scaling.min_workers",
            f"min_workers is {spec.scaling.min_workers} but this cluster can hold at "
            f"most {most} workers of {spec.scaling.worker_resources()}",
        )
    need = memory.estimate(spec)
    if need is None:
        return None
    have = memory.largest_node_memory(spec.scaling.worker_resources(), nodes)
    if have is not None and need.total > have:
        return SpecRefused(
            "hyperparameters",
            f"a worker needs {need.describe()}, more than the "
            f"{have / memory.GIB:.2f} GiB of memory of the largest node that could hold it",
            title="Job does not fit in memory",
            limit="node_memory",
        )
    return None


def fingerprint(spec: JobSpec) -> str:
    """What an Idempotency-Key's retry must repeat: the spec, as it was sent."""
    return hashlib.sha256(
        json.dumps(spec.model_dump(mode="json"), sort_keys=True).encode()
    ).hexdigest()
