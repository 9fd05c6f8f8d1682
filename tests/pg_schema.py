"""A scratch schema on a PostgreSQL server, for tests and benchmarks: runs never see each
other's tables, and the schema is dropped afterwards."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def scratch_schema(url: str, prefix: str) -> Iterator[str]:
    """A URL of ``url``'s server whose search path is a fresh schema, dropped on exit."""
    from sqlalchemy import create_engine, text

    schema = f"{prefix}_{secrets.token_hex(6)}"
    admin = create_engine(url)
    with admin.begin() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{url}{'&' if '?' in url else '?'}options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()
