"""The elastic-train client: ``Client`` / ``AsyncClient`` for Python, ``etrain`` for the shell.

Names are imported on first use, so that ``etrain`` commands load only what they need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.job_state import JobState
    from elastic_train.aio import AsyncClient, AsyncJob
    from elastic_train.client import Client, Job
    from elastic_train.errors import (
        ApiError,
        BadRequest,
        CheckpointCorrupt,
        CodeArchiveError,
        CodeTooLarge,
        ConfigError,
        Conflict,
        ConnectionFailed,
        ElasticTrainError,
        FieldError,
        Forbidden,
        InvalidRequest,
        NoCheckpoint,
        NotFound,
        PayloadTooLarge,
        RateLimited,
        ServerError,
        Unauthorized,
    )
    from elastic_train.models import Checkpoint, Event, JobInfo, LogLine, Me, MetricSeries
    from elastic_train.reporting import report

_WHERE = {
    "AsyncClient": "elastic_train.aio",
    "AsyncJob": "elastic_train.aio",
    "Client": "elastic_train.client",
    "Job": "elastic_train.client",
    **dict.fromkeys(
        [
            "ApiError",
            "BadRequest",
            "CheckpointCorrupt",
            "CodeArchiveError",
            "CodeTooLarge",
            "ConfigError",
            "Conflict",
            "ConnectionFailed",
            "ElasticTrainError",
            "FieldError",
            "Forbidden",
            "InvalidRequest",
            "NoCheckpoint",
            "NotFound",
            "PayloadTooLarge",
            "RateLimited",
            "ServerError",
            "Unauthorized",
        ],
        "elastic_train.errors",
    ),
    **dict.fromkeys(
        ["Checkpoint", "Event", "JobInfo", "LogLine", "Me", "MetricSeries"], "elastic_train.models"
    ),
    "JobState": "elastic.job_state",
    "report": "elastic_train.reporting",
}

__all__ = [
    "ApiError",
    "AsyncClient",
    "AsyncJob",
    "BadRequest",
    "Checkpoint",
    "CheckpointCorrupt",
    "Client",
    "CodeArchiveError",
    "CodeTooLarge",
    "ConfigError",
    "Conflict",
    "ConnectionFailed",
    "ElasticTrainError",
    "Event",
    "FieldError",
    "Forbidden",
    "InvalidRequest",
    "Job",
    "JobInfo",
    "JobState",
    "LogLine",
    "Me",
    "MetricSeries",
    "NoCheckpoint",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "ServerError",
    "Unauthorized",
    "report",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_train' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
