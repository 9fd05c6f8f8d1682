"""Every setting of the service, in one place. Each is read from an ``ETRAIN_`` variable."""

from __future__ import annotations

import importlib.util
import os
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="ETRAIN_", env_file=None, extra="ignore")

    host: str = Field("127.0.0.1", description="Address the HTTP server binds to.")
    port: int = Field(8000, ge=1, le=65535, description="Port the HTTP server listens on.")
    data_dir: Path = Field(
        Path(".etrain"),
        description="Where the embedded default keeps its SQLite file, the generated admin "
        "token and (unless checkpoint_dir says otherwise) checkpoints.",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL of the store, e.g. postgresql+psycopg://u@db/etrain. "
        "Unset: SQLite under data_dir.",
    )
    ray_address: str | None = Field(
        None,
        description="Address of an existing Ray cluster (e.g. ray://head:10001 or head:6379). "
        "Unset: the service starts a local Ray instance itself.",
    )
    ray_auth_token: SecretStr | None = Field(
        None,
        description="Token for a Ray cluster started with RAY_AUTH_MODE=token (Ray's own "
        "token authentication); used with ray_address. Unset: Ray's own RAY_AUTH_* "
        "variables, if any, apply.",
    )
    ray_auth_token_path: str | None = Field(
        None,
        description="A file holding that token instead (e.g. a mounted Kubernetes secret).",
    )
    ray_namespace: str = Field(
        "elastic-train",
        description="Ray namespace that holds the job supervisors; the service finds them "
        "there again after a restart.",
    )
    ray_num_cpus: int | None = Field(
        None, ge=1, description="Logical CPUs of the embedded Ray instance. Unset: all cores."
    )
    ray_num_gpus: int | None = Field(
        None, ge=0, description="GPUs of the embedded Ray instance. Unset: Ray detects them."
    )
    ray_dashboard_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Loopback port of the embedded Ray instance's dashboard. Unset: Ray's "
        "8265, or the next free port when another Ray holds it; the log says which.",
    )
    checkpoint_dir: str | None = Field(
        None,
        description="Where jobs write checkpoints: a directory every Ray node reaches (a "
        "shared volume on a real cluster), or a bucket (s3://bucket/prefix; its AWS_* "
        "variables go to the jobs, see docs/security.md). Unset: data_dir/checkpoints.",
    )
    api_token: SecretStr | None = Field(
        None,
        description="The bearer token every API call must carry. Unset: one is generated on "
        "first start, stored in data_dir/admin-token and printed.",
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="A scrape-only bearer token for GET /metrics (for Prometheus), so the "
        "scraper needs no admin token. Unset: only admin tokens may read /metrics.",
    )
    max_body_bytes: int = Field(
        1_048_576,
        ge=1024,
        le=1 << 30,
        description="Largest request body accepted; a bigger one is answered 413.",
    )
    rate_limit_per_s: float = Field(
        50.0,
        ge=0,
        description="Requests a second each API token may make on average "
        "(0: no limit); over it the answer is 429 with Retry-After.",
    )
    rate_limit_burst: int = Field(
        200,
        ge=1,
        description="Requests a token may make at once before the rate applies.",
    )
    entrypoint_modules: list[str] = Field(
        default_factory=list,
        description="Modules (or packages) whose functions jobs may name as a custom "
        "'package.module:function' workload. Empty: custom entrypoints are refused.",
    )
    event_poll_interval_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="How often the service collects new events from the job supervisors.",
    )
    sse_keepalive_s: float = Field(
        15.0, gt=0, le=300, description="Seconds between keep-alive comments on quiet streams."
    )
    sse_client_buffer: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="Events a live stream may fall behind before it is told to reconnect.",
    )
    dashboard_dir: Path | None = Field(
        None,
        description="Directory holding the web dashboard: its app/ and the node_modules/ "
        "that `npm ci` installs from dashboards/package-lock.json. Unset: the copy an "
        "installed wheel carries (the container image's too), else dashboards/ beside the "
        "source tree (a checkout after `make run`).",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of the service."
    )
    # -- what jobs may reach --------------------------------------------------------------
    data_roots: list[str] = Field(
        default_factory=list,
        description="Absolute directories whose files jobs may read as datasets; '{user}' "
        'stands for the job owner\'s name (e.g. ["/data/shared", "/data/home/{user}"]). '
        "Checked on the real path at submission; the service's own directories are never "
        "readable. Empty: jobs read no files (the synthetic dataset only).",
    )
    worker_env: list[str] = Field(
        default_factory=list,
        description="More environment variable names that reach the job workers of the "
        "embedded Ray, beyond the built-in allow-list (a trailing '*' matches a prefix). "
        "ETRAIN_ variables never do.",
    )
    mlflow_tracking_uri: SecretStr | None = Field(
        None,
        description="An MLflow tracking URI (http://mlflow:5000, sqlite:////shared/mlflow.db, "
        "databricks): each job's rank-0 worker logs its params, metrics and attempts to one "
        "run there. Needs the mlflow extra (pip install 'elastic-train[mlflow]') in the "
        "service and on every Ray node; the service refuses to start without it. The URI and "
        "the MLFLOW_TRACKING_* credential variables reach the jobs (docs/security.md). "
        "Unset: no MLflow logging.",
    )
    mlflow_experiment: str = Field(
        "elastic-train",
        min_length=1,
        description="The MLflow experiment that holds the jobs' runs (created if missing).",
    )
    # -- limits per user (defaults; an admin sets them per user with /v1/users/{name}/limits)
    min_cpus_per_worker: float = Field(
        1.0,
        gt=0,
        le=512,
        description="The fewest CPUs a worker may ask for; fewer is refused with 422.",
    )
    user_max_active_jobs: int = Field(
        10, ge=1, le=100_000, description="Jobs a user may have queued or running at once."
    )
    user_max_workers: int | None = Field(
        None,
        ge=1,
        description="Default quota: workers a user's jobs hold at once within quota (the "
        "scheduler queues a job past it, or lends it idle capacity). Unset: no limit.",
    )
    user_max_cpus: float | None = Field(
        None, gt=0, description="CPUs a user's active jobs may hold together. Unset: no limit."
    )
    user_max_gpus: int | None = Field(
        None,
        ge=0,
        description="Default quota: GPUs a user's jobs hold at once within quota (as "
        "user_max_workers). Unset: no limit.",
    )
    scheduler_dwell_s: float = Field(
        60.0,
        gt=0,
        description="The scheduler resizes a job for throughput (spare workers to the job "
        "that gains most from them) at most once in this many seconds; resizes for "
        "minimums, priorities and quotas are not held back.",
    )
    scheduler_starvation_s: float = Field(
        600.0,
        gt=0,
        description="A job that waited this long for its min_workers keeps later jobs of "
        "its priority or below from starting ahead of it.",
    )
    warm_processes_per_node: int = Field(
        0,
        ge=0,
        le=256,
        description="Idle processes each Ray node keeps with torch imported, at most one "
        "per CPU of the node, for the next jobs' workers to start in; the head node also "
        "keeps this many plain ones for the next jobs' supervisors. Each one taken is "
        "replaced once its node has had a CPU free for a few seconds, and no process hosts "
        "a second worker or supervisor. About 540 MB of memory each (PSS; 47 MB a "
        "supervisor's), no CPU or GPU held. 2 brings the README's job from its submission "
        "to its first step in 0.44 s (4.1 s without). 0, the default: none, and every "
        "worker starts a process and imports torch.",
    )
    user_max_wall_time_s: float | None = Field(
        7 * 24 * 3600.0,
        gt=0,
        description="How long one job may run (from its first running state) before the "
        "service cancels it. Unset: no limit.",
    )
    # -- the HTTP server ------------------------------------------------------------------
    max_header_bytes: int = Field(
        65_536,
        ge=4096,
        le=1 << 24,
        description="Largest request line plus headers; past it the connection gets 400 and "
        "is closed (also for a request that never ends its headers).",
    )
    header_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Seconds a connection may take to send a request's headers; past it, "
        "the connection is closed.",
    )
    max_connections: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="Connections the server holds open (more are closed at once) and "
        "requests it serves at a time (more are answered 503).",
    )
    max_streams_per_token: int = Field(
        32,
        ge=1,
        le=100_000,
        description="Live Server-Sent Event streams one token may hold open; past it, 429.",
    )
    # -- code packages (POST /v1/code) ---------------------------------------------------
    code_submission: bool = Field(
        True,
        description="Whether users may upload their own training code (POST /v1/code); an "
        "admin turns it on or off per user with the code_submission limit.",
    )
    max_code_bytes: int = Field(
        100 * 1024 * 1024,
        ge=1024,
        le=1 << 34,
        description="Largest code package (the tar.gz as uploaded), 100 MiB by default as "
        "Ray's own limit on a working directory; a bigger one is answered 413.",
    )
    max_code_files: int = Field(
        20_000, ge=1, le=10_000_000, description="Entries a code package may hold; past it, 422."
    )
    max_code_unpacked_bytes: int = Field(
        1 << 30,
        ge=1024,
        le=1 << 40,
        description="What a code package's files may add up to unpacked; past it, 422 (the "
        "check stops reading there: a zip bomb is never inflated).",
    )
    # -- stored data -----------------------------------------------------------------------
    retention_days: float = Field(
        30.0,
        ge=0,
        le=36_500,
        description="Days a finished job's metrics and log lines are kept (its record, "
        "state changes and checkpoints stay). 0: kept forever.",
    )

    @field_validator("data_roots")
    @classmethod
    def _absolute_roots(cls, roots: list[str]) -> list[str]:
        for root in roots:
            if not os.path.isabs(root) or "\x00" in root:
                raise ValueError(f"data root {root!r} is not an absolute path")
        return roots

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _mlflow_installed(cls, uri: SecretStr | None) -> SecretStr | None:
        # Checked here, at start-up, not when the first job's worker finds it missing.
        if uri is not None and importlib.util.find_spec("mlflow") is None:
            raise ValueError(
                "an MLflow tracking URI is set but mlflow is not installed: "
                "pip install 'elastic-train[mlflow]' (or unset ETRAIN_MLFLOW_TRACKING_URI)"
            )
        return uri

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'etrain.db').resolve()}"

    @cached_property
    def resolved_checkpoint_dir(self) -> str:
        if self.checkpoint_dir:
            return self.checkpoint_dir
        return str((self.data_dir / "checkpoints").resolve())

    @cached_property
    def private_dirs(self) -> list[str]:
        """The service's own directories: no job may read them, whatever the data roots."""
        dirs = [str(self.data_dir.resolve()), self.resolved_checkpoint_dir]
        url = self.resolved_database_url
        if url.startswith("sqlite:///"):
            dirs.append(os.path.dirname(os.path.abspath(url.removeprefix("sqlite:///"))))
        return dirs
