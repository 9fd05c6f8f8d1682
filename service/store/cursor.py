"""The jobs list's page cursor: opaque to clients, the last job id of the page inside."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Page:
    # Rows of SUMMARY_COLUMNS (attribute access, as a JobRow), without the spec.
    items: list[Any]
    next_cursor: str | None


def encode_cursor(job_id: str) -> str:
    return base64.urlsafe_b64encode(job_id.encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> str:
    try:
        value = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except ValueError as e:
        raise ValueError("cursor is not one this service gave out") from e
    if not value.startswith("job-"):
        raise ValueError("cursor is not one this service gave out")
    return value
