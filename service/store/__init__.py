"""The store package: tables (models), engines and migrations (database), the jobs list's
cursor, the event fold, and the Store's queries. Its names are re-exported here."""

from service.store.cursor import Page, decode_cursor, encode_cursor
from service.store.database import MIGRATIONS, POOL, SchemaTooNew, make_engine, migrate
from service.store.fold import PATH_EVENTS, event_dict, fold, job_relative, with_relative_paths
from service.store.models import (
    LIMIT_COLUMNS,
    MAX_METRIC_POINTS,
    METRIC_COLUMNS,
    PURGED_KINDS,
    SUMMARY_COLUMNS,
    Base,
    CheckpointRow,
    EventRow,
    IdempotencyRow,
    JobRow,
    MetricRow,
    TokenRow,
    UserLimitRow,
    UserRow,
    hash_secret,
    new_job_id,
    utcnow,
)
from service.store.queries import Store, metric_stride

__all__ = [
    "LIMIT_COLUMNS",
    "MAX_METRIC_POINTS",
    "METRIC_COLUMNS",
    "MIGRATIONS",
    "PATH_EVENTS",
    "POOL",
    "PURGED_KINDS",
    "SUMMARY_COLUMNS",
    "Base",
    "CheckpointRow",
    "EventRow",
    "IdempotencyRow",
    "JobRow",
    "MetricRow",
    "Page",
    "SchemaTooNew",
    "Store",
    "TokenRow",
    "UserLimitRow",
    "UserRow",
    "decode_cursor",
    "encode_cursor",
    "event_dict",
    "fold",
    "hash_secret",
    "job_relative",
    "make_engine",
    "metric_stride",
    "migrate",
    "new_job_id",
    "utcnow",
    "with_relative_paths",
]
