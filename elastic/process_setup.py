"""Set-up of every Ray worker process, before Ray runs anything in it: Ray's worker process
set-up hook, named in the environment a Ray instance starts with (``jobs.launcher.
worker_setup``: the embedded Ray, the test suite's cluster, the Helm chart's Ray pods).
Imports only the standard library at module level: a hook that fails to import ends every
worker."""

from __future__ import annotations

import os
from typing import Any

# Ray's worker process imports and calls it at start ("module.function"), when it is named
# in the environment under ``ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR``.
SETUP_HOOK = "elastic.process_setup.set_up"

# Set (to PRELOAD_TRAINING) in the runtime env of the processes that train
# (``elastic.warm_processes.TRAINING_ENV``): the hook imports what training needs before the
# process is handed to an actor, so that a process waiting in a node's pool has done it. Not
# an ``ETRAIN_`` name: those are the service's settings, none of which reaches a worker.
PRELOAD = "ELASTIC_TRAIN_PRELOAD"
PRELOAD_TRAINING = "training"
# torch and the optimizer's lazy ``torch._dynamo`` (over a second each, in a new process),
# then both modes' training contexts and torchft, and the supervisor's actor class, which a
# worker unpickles (importing its modules) when it looks its supervisor up. None of them
# touches CUDA: a pool's process is handed to an actor before it learns which GPU is its
# (``CUDA_VISIBLE_DEVICES`` is set for the actor and read at CUDA's first use).
TRAINING_MODULES = (
    "torch",
    "torch._dynamo",
    "torchft",
    "elastic.train.context",
    "elastic.in_place.context",
    "elastic.supervisor.actor",
)

# Whether this process was started ahead of any job (for a node's pool, ``elastic.
# warm_processes``), not for an actor that was waiting for it: when a job's actor takes it,
# a new one is started in its place.
from_pool = False
# Whether the hook imported what training needs (the process has the training runtime env).
preloaded = False


def set_up() -> None:
    """Every worker process: a lean serialization context; a training process also imports
    what training needs."""
    global from_pool, preloaded
    lean_serialization()
    # Ray gives a process started ahead of any lease the nil job id.
    from_pool = set(os.environ.get("RAY_JOB_ID", "f")) == {"f"}
    if os.environ.get(PRELOAD) == PRELOAD_TRAINING:
        preload(TRAINING_MODULES)
        preloaded = True


def fit_threads() -> None:
    """In a process that imported torch ahead (:func:`set_up`), once an actor is in it:
    torch's threads to the actor's CPUs. Ray sets ``OMP_NUM_THREADS`` (the actor's whole
    CPUs, unless the environment set it) when it creates the actor, after the import, and
    OpenMP and torch's own pool read it only once: left alone, every worker on a node would
    run as many threads as the node has cores, and the node's workers would crowd each
    other's cores (the suite's in-place jobs trained 4 times slower)."""
    if not preloaded:
        return
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def preload(modules: tuple[str, ...]) -> None:
    """Import ``modules``, then keep what they made out of the collector's sight: it lives
    as long as the process, and each full collection would scan it again."""
    import gc
    import importlib
    import logging

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # the actor's own import reports it where it is seen
            logging.getLogger(__name__).warning("preloading %s: %r", name, e)
    gc.collect()
    gc.freeze()


def lean_serialization() -> None:
    """Ray's serialization context, made when a process receives its first argument,
    registers serializers for FastAPI's pydantic fields, Starlette's ``State`` and Arrow's
    tables (``ray.util.serialization_addons.apply``), importing pydantic, Starlette,
    pyarrow and numpy to do so: 25 MB of every worker process, a third of a job's
    supervisor. No process of ours sends those types, so the context is made without them
    (a pydantic model, for one, is pickled as any object is)."""
    from ray.util import serialization_addons

    serialization_addons.apply = _no_addons


def _no_addons(serialization_context: Any) -> None:
    return None
