"""Limits an admin sets per user; checkpoint paths kept relative to their job.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import os

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

PATH_EVENTS = ("checkpoint_saved", "checkpoint_removed", "checkpoint_corrupt")


def _relative(path: str, job_id: str) -> str:
    # As service.store.job_relative does; kept here so this revision never changes.
    marker = f"/{job_id}/"
    at = path.rfind(marker)
    return path[at + len(marker) :] if at >= 0 else os.path.basename(path.rstrip("/"))


def upgrade() -> None:
    op.create_table(
        "user_limits",
        sa.Column("user", sa.String(64), sa.ForeignKey("users.name"), primary_key=True),
        sa.Column("max_active_jobs", sa.Integer, nullable=True),
        sa.Column("max_workers", sa.Integer, nullable=True),
        sa.Column("max_cpus", sa.Float, nullable=True),
        sa.Column("max_gpus", sa.Integer, nullable=True),
        sa.Column("max_wall_time_s", sa.Float, nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    conn = op.get_bind()
    checkpoints = sa.table("checkpoints", sa.column("job_id"), sa.column("step"), sa.column("path"))
    for job_id, step, path in conn.execute(
        sa.select(checkpoints.c.job_id, checkpoints.c.step, checkpoints.c.path)
    ).all():
        if path.startswith("/"):
            conn.execute(
                checkpoints.update()
                .where(checkpoints.c.job_id == job_id, checkpoints.c.step == step)
                .values(path=_relative(path, job_id))
            )
    events = sa.table(
        "job_events",
        sa.column("job_id"),
        sa.column("seq"),
        sa.column("kind"),
        sa.column("data", sa.JSON),
    )
    found = conn.execute(
        sa.select(events.c.job_id, events.c.seq, events.c.data).where(
            events.c.kind.in_(PATH_EVENTS)
        )
    ).all()
    for job_id, seq, data in found:
        path = data.get("path") if isinstance(data, dict) else None
        if isinstance(path, str) and path.startswith("/"):
            conn.execute(
                events.update()
                .where(events.c.job_id == job_id, events.c.seq == seq)
                .values(data={**data, "path": _relative(path, job_id)})
            )


def downgrade() -> None:
    op.drop_table("user_limits")
