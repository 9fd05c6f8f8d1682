"""An index on jobs (owner, state): an owner's live jobs without a walk through all theirs.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # if_not_exists: a database made by create_all from these models has it already.
    op.create_index("ix_jobs_owner_state", "jobs", ["owner", "state"], if_not_exists=True)


def downgrade() -> None:
    op.drop_index("ix_jobs_owner_state", table_name="jobs")
