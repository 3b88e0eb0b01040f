"""A subagent row says whether it runs in the background (docs/agents.md#background-subagents): its
supervisor's delegate call returned at once with it as a handle. False on every row stored before.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 22:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "subagent_sessions",
        sa.Column("background", sa.Boolean(), server_default=sa.false(), nullable=False),
    )


def downgrade() -> None:
    with op.batch_alter_table("subagent_sessions") as batch:
        batch.drop_column("background")
