"""Places jobs on Ray: connects to the cluster, starts each job's supervisor, finds it again."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray
from ray._private import ray_constants
from ray.exceptions import RayActorError

from elastic import process_setup
from elastic.checkpoint.storage import join_location
from elastic.cluster import capacity, scheduling
from elastic.job_state import JobState
from elastic.supervisor.actor import Supervisor, SupervisorPlan
from jobs import isolation, ray_auth
from jobs.code_store import CodeStore, owner_key
from jobs.spec import JobSpec
from jobs.workloads import WORKLOADS

log = logging.getLogger(__name__)

# What a call to a supervisor raises when its actor has died: the service needs the name,
# not Ray.
SupervisorGone = RayActorError

ACTOR_PREFIX = "etrain-supervisor-"
# The training loop of every job running its owner's code: it runs the spec's command, or
# the package's train_loop, in a confined child (elastic/train/command.py).
COMMAND_LOOP = "elastic.train.command:run_command"
# Beside the jobs' checkpoints: each command job's own directory, under its owner's.
FILES_DIR = "_files"
# For a Ray instance the service starts itself (and the Helm chart's Ray, as environment
# variables): a node that stops answering is declared dead after 3 s (its connections
# refused) to 6 s (its packets dropped: each check waits out its 1 s), so elastic recovery
# starts sooner. Ray's defaults (a check every 3 s, each waiting up to 10 s for its answer,
# 5 missed) take 15 s for a node whose connections are refused, and about a minute for one
# cut off (its packets dropped), where every check waits out its timeout.
FAST_FAILURE_DETECTION = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
# Ray's switch that, when off, makes every node address the loopback one.
_LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@dataclass(frozen=True)
class MlflowTarget:
    tracking_uri: str
    experiment: str


# Where jobs launched by this process log to MLflow (the service's setting; None: nowhere).
# Process-wide like the Ray connection: one service per process.
_mlflow: MlflowTarget | None = None


def configure_mlflow(target: MlflowTarget | None) -> None:
    global _mlflow
    _mlflow = target


def ray_auth_env(token: str | None, token_path: str | None) -> dict[str, str]:
    """The variables that make Ray's clients (this driver, and Ray's own C++ core) present
    a token to a cluster started with ``RAY_AUTH_MODE=token``. Empty: no token configured,
    and whatever the environment already says stays in force."""
    if token:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}
    if token_path:
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}
    return {}


def connect(
    address: str | None,
    namespace: str,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    auth_token: str | None = None,
    auth_token_path: str | None = None,
    worker_env: Iterable[str] = (),
    dashboard_port: int | None = None,
) -> bool:
    """Join ``address`` (with Ray's token authentication when a token is given), or start a
    local Ray instance when it is None, whose processes (and so every job's workers) get
    only the allow-listed environment (``jobs.isolation``; ``worker_env`` adds names), and
    whose dashboard is on ``dashboard_port`` (None: Ray's 8265, or the next free port). A
    no-op when this process is already connected (tests share one cluster). Returns whether
    this call connected: then ``disconnect`` is the caller's to call."""
    if ray.is_initialized():
        return False
    if address:
        # Read by Ray's C++ token loader at init: it must be in the environment first.
        os.environ.update(ray_auth_env(auth_token, auth_token_path))
        ray_auth.check_token(address, bool(auth_token or auth_token_path))
        ray.init(address=address, namespace=namespace, log_to_driver=False)
        return True
    keep_ray_on_loopback()
    # Ray's processes inherit this process's environment, the service's secrets with it.
    environment = {**isolation.worker_environment(os.environ, worker_env), **worker_setup()}
    with isolation.only_environment(environment):
        context = ray.init(
            # "local" always starts a new instance: a bare init would try to join a stale
            # cluster that an earlier crash left recorded in Ray's temp dir.
            address="local",
            namespace=namespace,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            log_to_driver=False,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            dashboard_port=dashboard_port,
            _system_config=FAST_FAILURE_DETECTION,
        )
    log.info("the embedded Ray's dashboard is on http://%s", context.dashboard_url)
    return True


def worker_setup() -> dict[str, str]:
    """The environment that makes every worker process of a Ray instance started with it
    run ``elastic.process_setup``'s hook first: its serialization context is made without
    the add-ons for types it never sends (25 MB of each process)."""
    return {ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR: process_setup.SETUP_HOOK}


def disconnect() -> None:
    """Leave the cluster; a local instance that ``connect`` started is stopped with it (the
    jobs' supervisors and workers end with it; they resume when the service comes back).

    Called while the process still runs, not left to Ray's exit hook: Ray starts a local
    instance's processes from the thread that called ``connect`` and has the kernel kill
    them when that thread ends (``PR_SET_PDEATHSIG``), and the thread pool's threads end at
    interpreter exit before any exit hook, so the hook found its GCS already killed and spent
    about 15 s in timeouts of Ray's own (SIGTERM of `etrain serve` took 16 s with no job)."""
    ray.shutdown()


def export_supervisor_class() -> bool:
    """Send the supervisor's actor class to the cluster now, as Ray itself does at the
    class's first ``.remote()`` in a process (``ray.actor.ActorClass._remote``, Ray 2.x): it
    pickles the class by value, holding the GIL for 0.1-0.25 s on 2 cores, which stalled
    every request of a service that had just said it was ready (the first submission's
    launch, bench/api_load.py). Done once at start-up, the first launch finds it done.
    Returns whether it is exported (False: this Ray has other internals; Ray exports it at
    the first launch, as before)."""
    from ray._private.worker import global_worker

    meta = getattr(Supervisor, "__ray_metadata__", None)
    manager = getattr(global_worker, "function_actor_manager", None)
    if meta is None or manager is None or not hasattr(meta, "last_export_cluster_and_job"):
        return False
    if meta.last_export_cluster_and_job != global_worker.current_cluster_and_job:
        manager.export_actor_class(
            meta.modified_class,
            meta.actor_creation_function_descriptor,
            meta.method_meta.methods.keys(),
        )
        meta.last_export_cluster_and_job = global_worker.current_cluster_and_job
    return True


def supervisor_class_exported() -> bool:
    """Whether this process has sent the supervisor's class to the cluster it is on."""
    from ray._private.worker import global_worker

    meta = getattr(Supervisor, "__ray_metadata__", None)
    exported = getattr(meta, "last_export_cluster_and_job", None)
    return exported is not None and exported == global_worker.current_cluster_and_job


def keep_ray_on_loopback() -> None:
    """Make a Ray instance started from this process use loopback addresses only: an
    embedded instance is for this machine alone (Ray otherwise advertises the host's
    network address). Child processes inherit the setting."""
    os.environ[_LOOPBACK_ONLY_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def is_connected() -> bool:
    return ray.is_initialized()


def supervisor_name(job_id: str) -> str:
    return ACTOR_PREFIX + job_id


def max_workers_ever(spec: JobSpec, nodes: Iterable[Mapping[str, float]]) -> int:
    """How many of the spec's workers a cluster of ``nodes`` (each node's total resources)
    could hold if it ran nothing else."""
    return scheduling.workers_that_fit(nodes, spec.scaling.worker_resources())


@dataclass(frozen=True)
class Resume:
    """What the store knows of a job whose supervisor died, for the one that replaces it."""

    state: str
    step: int
    world_size: int
    # Per sender of workers' numbered news, the last number the service stored.
    delivered: dict[str, int] = field(default_factory=dict)


def checkpoint_dir(checkpoint_root: str, job_id: str) -> str:
    return os.path.join(checkpoint_root, job_id)


def files_dir(checkpoint_root: str, owner: str, job_id: str) -> str:
    """A command job's own directory (``ETRAIN_CHECKPOINT_DIR``), under its owner's."""
    return join_location(checkpoint_root, f"{FILES_DIR}/{owner_key(owner)}/{job_id}")


def command_plan(
    job_id: str, spec: JobSpec, checkpoint_root: str, owner: str, data_roots: Sequence[str] = ()
) -> dict[str, Any]:
    """What every worker of a job running its owner's code is given (a command, or a
    ``train_loop`` of its code package: ``elastic.train.command.CommandPlan``);
    ``data_roots``: what the owner's code may read besides its own."""
    assert spec.runs_user_code
    return {
        "argv": list(spec.command or []),
        "entrypoint": spec.workload if spec.runs_package_loop else None,
        "job_id": job_id,
        "owner": owner,
        "code": CodeStore(checkpoint_root).location(owner, spec.code) if spec.code else None,
        "files_dir": files_dir(checkpoint_root, owner, job_id),
        "stop_grace_s": spec.stop_grace_s,
        "max_restarts": spec.failure.max_restarts,
        "data_roots": list(data_roots),
        "requirements": list(spec.requirements),
        "cpus": spec.scaling.cpus_per_worker,
        "memory_gb": spec.scaling.memory_per_worker_gb,
        "framework": spec.framework,
    }


def launch(
    job_id: str,
    spec: JobSpec,
    checkpoint_root: str,
    namespace: str,
    first_seq: int,
    resume: Resume | None = None,
    owner: str = "",
    submitted_at: float = 0.0,
    data_roots: Sequence[str] = (),
    ready_processes: bool = True,
) -> Any:
    """Start the job's supervisor (detached: it outlives the API process) and its loop;
    with ``resume``, a new supervisor for a job whose supervisor died. ``ready_processes``:
    the nodes keep processes ready to train (``ETRAIN_WARM_PROCESSES_PER_NODE``), and the
    job's workers are made to start in them."""
    workload = WORKLOADS.get(spec.workload)
    train_loop = workload.train_loop if workload else spec.workload
    train_config = spec.train_config()
    backend = spec.backend
    if spec.runs_user_code:
        train_loop = COMMAND_LOOP
        train_config["command"] = command_plan(job_id, spec, checkpoint_root, owner, data_roots)
        # The workers' own group only agrees on how the commands are doing, on the CPU;
        # the command (or the package's loop) forms its own group, NCCL or Gloo.
        backend = "gloo"
    if _mlflow is not None:
        # Read by the rank-0 worker (elastic.train.mlflow_log); the URI goes in the environment.
        train_config["_mlflow"] = {
            "job_id": job_id,
            "job_name": spec.name,
            "min_workers": spec.scaling.min_workers,
            "max_workers": spec.scaling.max_workers,
        }
    plan = SupervisorPlan(
        job_id=job_id,
        train_loop=train_loop,
        train_config=train_config,
        min_workers=spec.scaling.min_workers,
        max_workers=spec.scaling.max_workers,
        resources_per_worker=spec.scaling.worker_resources(),
        backend=backend,
        checkpoint_dir=checkpoint_dir(checkpoint_root, job_id),
        every_steps=spec.checkpoint.every_steps,
        keep=spec.checkpoint.keep,
        max_restarts=spec.failure.max_restarts,
        min_workers_grace_s=spec.failure.min_workers_grace_s,
        actor_name=supervisor_name(job_id),
        namespace=namespace,
        initial_state=JobState(resume.state) if resume else JobState.QUEUED,
        recreated=resume is not None,
        last_step=resume.step if resume else 0,
        last_world_size=resume.world_size if resume else 0,
        delivered=dict(resume.delivered) if resume else {},
        # Every attempt took a sequence number for its attempt_started event: none is above.
        first_attempt=first_seq if resume else 1,
        fault_tolerance=spec.recovery_mode,
        owner=owner,
        priority=spec.priority_value,
        submitted_at=submitted_at,
        own_checkpoints=spec.command is not None,
        ready_processes=ready_processes,
    )
    options: dict[str, Any] = {
        "name": plan.actor_name,
        "namespace": namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        **capacity.on_head_node(),
    }
    env = isolation.storage_environment(os.environ, checkpoint_root)
    if _mlflow is not None:
        env.update(
            isolation.mlflow_environment(os.environ, _mlflow.tracking_uri, _mlflow.experiment)
        )
    if env:
        options["runtime_env"] = {"env_vars": env}  # attempts and workers inherit it
    handle = Supervisor.options(**options).remote(plan, first_seq)  # type: ignore[attr-defined]
    handle.start.remote()
    return handle


def find_supervisor(job_id: str, namespace: str) -> Any | None:
    try:
        return ray.get_actor(supervisor_name(job_id), namespace=namespace)
    except ValueError:
        return None


def stop_supervisor(handle: Any, job_id: str, namespace: str) -> None:
    """Calls to Ray's GCS: run it off the event loop."""
    ray.kill(handle, no_restart=True)
    end_attempt_leftovers(job_id, namespace)


def end_attempt_leftovers(job_id: str, namespace: str) -> None:
    """In place, an attempt's replicas and lighthouse outlive its supervisor (a new one adopts
    them): whatever is left of them is ended with the job. Not connected to Ray, there is
    nothing to end (and Ray's calls would start a connection, to whatever cluster they find)."""
    if not ray.is_initialized():
        return
    from elastic.in_place.runner import end_leftovers

    end_leftovers(supervisor_name(job_id), namespace)
