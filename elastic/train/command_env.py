"""What a command job's process is given: torchrun's environment, and nothing of the
worker's own. Pure: the worker (``elastic/train/command.py``) gathers the facts."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elastic.train import command_limits

# The worker's variables a user's process keeps: what a process, Python, torch and the
# accelerators need. Nothing of Ray's (its address, its token), nothing of the service's.
KEPT_NAMES = frozenset(
    {
        "PATH",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TERM",
        "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CUDA_VISIBLE_DEVICES",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
    }
)
KEPT_PREFIXES = ("LC_", "OMP_", "MKL_", "NCCL_", "NVIDIA_")
# The variable through which ``elastic_train.report`` finds its pipe to the worker.
REPORT_FD_ENV = "ETRAIN_REPORT_FD"
CHECKPOINT_DIR_ENV = "ETRAIN_CHECKPOINT_DIR"
# The variable through which a loop run from a code package reads its worker's answers.
REPLY_FD_ENV = "ETRAIN_REPLY_FD"
# What a command job's processes are set up for: torchrun's environment alone, or also the
# variables another framework's launcher gives each of its workers.
PYTORCH, TENSORFLOW = "pytorch", "tensorflow"
FRAMEWORKS = (PYTORCH, TENSORFLOW)
# Frameworks whose workers each listen on a port of their own, which every worker is told.
NEEDS_ENDPOINTS = frozenset({TENSORFLOW})
TF_CONFIG_ENV = "TF_CONFIG"
# Unprivileged ids a job's process runs as when the workers run as root: one per owner, so
# that owners' files and processes are apart (see docs/security.md for the odds of two
# owners sharing one).
FIRST_UID, UIDS = 30_000, 20_000


def uid_of(owner: str) -> int:
    """The uid (and gid) a job of ``owner`` runs as where the workers are root."""
    digest = hashlib.sha256(owner.encode()).digest()
    return FIRST_UID + int.from_bytes(digest[:8], "big") % UIDS


@dataclass(frozen=True)
class Place:
    """Where one worker is among the attempt's: torchrun's local and group ranks."""

    local_rank: int
    local_world_size: int
    group_rank: int
    group_world_size: int


def places(nodes: Sequence[str]) -> list[Place]:
    """Each rank's place, given each rank's node: ranks on one node are numbered in rank
    order, and nodes in the order of their first rank (as torchrun numbers its agents)."""
    order: dict[str, int] = {}
    for node in nodes:
        order.setdefault(node, len(order))
    seen: dict[str, int] = {}
    out = []
    for node in nodes:
        local = seen.get(node, 0)
        seen[node] = local + 1
        out.append(Place(local, nodes.count(node), order[node], len(order)))
    return out


def torchrun_variables(
    rank: int,
    world_size: int,
    place: Place,
    master_addr: str,
    master_port: int,
    restart_count: int,
    max_restarts: int,
    run_id: str,
) -> dict[str, str]:
    """The variables torchrun gives each worker it starts."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(place.local_rank),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_RANK": str(place.group_rank),
        "GROUP_WORLD_SIZE": str(place.group_world_size),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def endpoint(host: str, port: int) -> str:
    """``host:port`` as gRPC takes it: an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tf_config(rank: int, endpoints: Sequence[tuple[str, int]]) -> str:
    """``TF_CONFIG`` for ``rank``: what ``tf.distribute.MultiWorkerMirroredStrategy`` reads
    (through its ``TFConfigClusterResolver``). Every rank is a ``worker`` and the task's
    index is its rank, so worker 0, TensorFlow's chief for checkpoints and
    ``BackupAndRestore``, is rank 0; ``endpoints`` are every rank's, in rank order."""
    if not 0 <= rank < len(endpoints):
        raise ValueError(f"rank {rank} is not one of the {len(endpoints)} workers")
    cluster = {"worker": [endpoint(host, port) for host, port in endpoints]}
    return json.dumps({"cluster": cluster, "task": {"type": "worker", "index": rank}})


def framework_variables(
    framework: str, rank: int, endpoints: Sequence[tuple[str, int]]
) -> dict[str, str]:
    """What ``framework``'s own launcher would add to torchrun's variables for ``rank``
    (``endpoints``: every rank's own ``(host, port)``, for the frameworks that need them)."""
    if framework == PYTORCH:
        return {}
    if framework == TENSORFLOW:
        return {TF_CONFIG_ENV: tf_config(rank, endpoints)}
    raise ValueError(f"unknown framework {framework!r}: one of {', '.join(FRAMEWORKS)}")


def child_environment(
    worker_env: Mapping[str, str],
    home: str,
    added: Mapping[str, str],
    cpus: float | None = None,
) -> dict[str, str]:
    """The worker's environment cut to what a user's process may see, plus ``added``; with
    ``cpus``, thread pools sized to them where the worker's environment does not say."""
    kept = {k: v for k, v in worker_env.items() if k in KEPT_NAMES or k.startswith(KEPT_PREFIXES)}
    tmp = os.path.join(home, ".tmp")
    return {
        **command_limits.thread_variables(cpus, kept),
        **kept,
        "HOME": home,
        "TMPDIR": tmp,
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        **added,
    }


def resolve_argv(argv: Sequence[str], python: str = sys.executable) -> list[str]:
    """``python`` (or ``python3``) as the command's program is the workers' interpreter,
    the one with torch: a worker's PATH may name another, or none."""
    first, *rest = argv
    return [python if first in ("python", "python3") else first, *rest]
