"""Engines (SQLite or PostgreSQL) with their pools, and the schema's migrations."""

from __future__ import annotations

import os
from typing import Any

from sqlalchemy import create_engine, event, inspect
from sqlalchemy.engine import Engine


class SchemaTooNew(RuntimeError):
    """The database was migrated by a newer elastic-train than this one."""


MIGRATIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "migrations")


def migrate(engine: Engine) -> None:
    """Bring the schema to this version's head with Alembic; refuse a newer one."""
    from alembic import command
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    config = Config()
    config.set_main_option("script_location", MIGRATIONS)
    scripts = ScriptDirectory.from_config(config)
    with engine.begin() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
        if current is not None and current not in {s.revision for s in scripts.walk_revisions()}:
            raise SchemaTooNew(
                f"the database at {engine.url.render_as_string(hide_password=True)} has schema "
                f"revision {current!r}, newer than this elastic-train knows (its newest is "
                f"{scripts.get_current_head()!r}); upgrade elastic-train or use another database"
            )
        config.attributes["connection"] = conn
        if current is None and inspect(conn).has_table("jobs"):
            # Made by the walking skeleton's create_all, before migrations existed.
            command.stamp(config, "0001")
        command.upgrade(config, "head")


# As many connections kept open as requests run at once (FastAPI's 40 threads for plain
# routes, the event loop's executor for the rest): SQLAlchemy's default of 5 made 50
# concurrent clients queue for a connection, and each overflow connection was opened (with
# its PRAGMAs) and closed again per request (a profile under bench/api_load.py showed both).
POOL: dict[str, Any] = {"pool_size": 40, "max_overflow": 24, "pool_timeout": 30}


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        engine = create_engine(
            url, connect_args={"check_same_thread": False, "timeout": 30}, **POOL
        )

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            # WAL: readers never wait for the event writer; foreign keys: SQLite needs asking.
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, **POOL)
