"""What a job's processes get from the service that started them.

**Environment.** Ray's processes (GCS, raylet, dashboard) and every worker they start take
the environment of the process that started Ray. For the embedded default that is the
service, whose environment holds its secrets (``ETRAIN_API_TOKEN``, the database URL, ...).
So the embedded Ray is started with an environment built here from an allow-list: what
Python, Ray, torch and the accelerators need, plus the names an admin adds
(``ETRAIN_WORKER_ENV``); never an ``ETRAIN_`` variable, and never Ray's auth token unless
Ray itself runs with token authentication. On an external cluster the workers have the
environment of the Ray nodes (set where the cluster is deployed) plus what a job's
``runtime_env`` adds; the service sends none of its own variables there.

**Files.** The service's own directories (data dir, checkpoints, the SQLite file's
directory, Ray's session directory with every worker's log) are never a data path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping

# Exact names that reach workers: the process basics, Python's own switches, TLS trust.
ALLOWED_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TERM",
        "TMPDIR",
        "TEMP",
        "TMP",
        "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONUNBUFFERED",
        "PYTHONHASHSEED",
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONWARNINGS",
        "PYTHONFAULTHANDLER",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
    }
)
# Prefixes that reach workers: locale, Ray's own configuration, torch and the accelerators'
# and math libraries' tuning.
ALLOWED_PREFIXES = (
    "LC_",
    "RAY_",
    "CUDA_",
    "NCCL_",
    "GLOO_",
    "TORCH_",
    "TORCHINDUCTOR_",
    "TRITON_",
    "NVIDIA_",
    "HIP_",
    "ROCR_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
)
# The service's own variables; never passed on, whatever the allow-list says.
SERVICE_PREFIX = "ETRAIN_"
RAY_AUTH_VARIABLES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _matches(name: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        if pattern.endswith("*") and name.startswith(pattern[:-1]):
            return True
        if name == pattern:
            return True
    return False


def worker_environment(environ: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """The variables of ``environ`` that job workers may see: the allow-list plus ``extra``
    (names, or prefixes ending in '*'), less every ``ETRAIN_`` variable, and less Ray's auth
    token unless Ray runs with token authentication (then its own processes need it)."""
    extra = list(extra)
    ray_token_needed = environ.get("RAY_AUTH_MODE", "").lower() == "token"
    out: dict[str, str] = {}
    for name, value in environ.items():
        if name.startswith(SERVICE_PREFIX):
            continue
        if name in RAY_AUTH_VARIABLES and not ray_token_needed:
            continue
        if name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES) or _matches(name, extra):
            out[name] = value
    return out


@contextlib.contextmanager
def only_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Inside: ``os.environ`` is exactly ``env`` (what processes started now inherit).
    After: the variables taken away are back; any that the code inside set are kept."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if name not in os.environ or name not in env:
                os.environ[name] = value


def ray_temp_dirs() -> list[str]:
    """Where Ray keeps its sessions (sockets, and the log of every worker of every job):
    Ray's default, and the one this process's Ray instance uses."""
    import ray
    from ray._common.utils import get_default_ray_temp_dir

    dirs = [str(get_default_ray_temp_dir())]  # type: ignore[no-untyped-call]
    if ray.is_initialized():
        with contextlib.suppress(Exception):  # a client connection may not know it
            dirs.append(str(ray.get_runtime_context().get_temp_dir()))
    return dirs
