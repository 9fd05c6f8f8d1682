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

**Checkpoint storage.** When checkpoints go to an object store (``ETRAIN_CHECKPOINT_DIR``
is ``s3://``, ``gs://`` or ``abfs://``), the store's own variables in the service's
environment (:data:`STORAGE_VARIABLES`, for that scheme only) are handed to each job's
supervisor as its Ray ``runtime_env``, which its attempts and workers inherit: the
supervisor lists and verifies checkpoints and the workers write and read them. On the
embedded Ray and on an external cluster alike, nothing else of the service's goes with them.

**MLflow.** With ``ETRAIN_MLFLOW_TRACKING_URI`` set, each job's supervisor ``runtime_env``
also carries ``MLFLOW_TRACKING_URI`` (the setting's value, credentials in it included),
``MLFLOW_EXPERIMENT_NAME``, and those of :data:`MLFLOW_VARIABLES` present in the service's
environment (the tracking server's credentials and TLS trust).

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
# What pyarrow.fs reads to reach each object store, by the checkpoint URI's scheme.
_S3_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CA_BUNDLE",
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
)
_GCS_VARIABLES = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT")
_AZURE_VARIABLES = (
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_TENANT_ID",
)
STORAGE_VARIABLES: dict[str, tuple[str, ...]] = {
    "s3": _S3_VARIABLES,
    "gs": _GCS_VARIABLES,
    "gcs": _GCS_VARIABLES,
    "abfs": _AZURE_VARIABLES,
    "abfss": _AZURE_VARIABLES,
}

# What the MLflow client reads to reach and trust a tracking server.
MLFLOW_VARIABLES = (
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_TRACKING_INSECURE_TLS",
    "MLFLOW_TRACKING_SERVER_CERT_PATH",
    "MLFLOW_TRACKING_CLIENT_CERT_PATH",
)


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


def storage_environment(environ: Mapping[str, str], checkpoint_root: str) -> dict[str, str]:
    """The variables of ``environ`` that a job's processes need to reach the object store
    ``checkpoint_root`` names (none for a filesystem path)."""
    scheme, sep, _ = checkpoint_root.partition("://")
    names = STORAGE_VARIABLES.get(scheme.lower(), ()) if sep else ()
    return {name: environ[name] for name in names if name in environ}


def mlflow_environment(
    environ: Mapping[str, str], tracking_uri: str, experiment: str
) -> dict[str, str]:
    """The variables a job's rank-0 worker needs to log to the tracking server."""
    env = {name: environ[name] for name in MLFLOW_VARIABLES if name in environ}
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    env["MLFLOW_EXPERIMENT_NAME"] = experiment
    return env


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

    dirs = [str(get_default_ray_temp_dir())]
    if ray.is_initialized():
        with contextlib.suppress(Exception):  # a client connection may not know it
            dirs.append(str(ray.get_runtime_context().get_temp_dir()))
    return dirs
