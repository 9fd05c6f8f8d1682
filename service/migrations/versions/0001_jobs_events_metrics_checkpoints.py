"""Jobs, their event log, metrics and checkpoints (the walking skeleton's schema).

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("owner", sa.String(128), nullable=False, index=True),
        sa.Column("workload", sa.String(256), nullable=False),
        sa.Column("spec", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False, index=True),
        sa.Column("message", sa.Text, nullable=True),
        sa.Column("world_size", sa.Integer, nullable=False),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("total_steps", sa.Integer, nullable=True),
        sa.Column("last_loss", sa.Float, nullable=True),
        sa.Column("samples_per_s", sa.Float, nullable=True),
        sa.Column("restarts", sa.Integer, nullable=False),
        sa.Column("last_seq", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_table(
        "job_events",
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
    )
    op.create_table(
        "metrics",
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("seq", sa.Integer, primary_key=True),
        sa.Column("step", sa.Integer, nullable=False),
        sa.Column("time", sa.Float, nullable=False),
        sa.Column("loss", sa.Float, nullable=True),
        sa.Column("accuracy", sa.Float, nullable=True),
        sa.Column("samples_per_s", sa.Float, nullable=True),
        sa.Column("learning_rate", sa.Float, nullable=True),
        sa.Column("world_size", sa.Integer, nullable=True),
    )
    op.create_table(
        "checkpoints",
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("step", sa.Integer, primary_key=True),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("size_bytes", sa.Integer, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("removed", sa.Boolean, nullable=False),
    )


def downgrade() -> None:
    for table in ("checkpoints", "metrics", "job_events", "jobs"):
        op.drop_table(table)
