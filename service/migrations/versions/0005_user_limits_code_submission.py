"""A per-user switch for code submission (uploaded code packages).

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("user_limits") as batch:
        batch.add_column(sa.Column("code_submission", sa.Boolean, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("user_limits") as batch:
        batch.drop_column("code_submission")
