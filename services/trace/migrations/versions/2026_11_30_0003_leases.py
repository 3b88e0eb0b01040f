"""Leases on work in progress: a pending assistant placeholder, an unfinished A2A task and an unfinished
subagent each carry the time their runner last promised to be alive (NULL: their creation counts).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30 20:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("messages", "a2a_tasks", "subagent_sessions")


def upgrade() -> None:
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True))
    # The reaper looks for unfinished work only: small partial indexes.
    op.create_index(
        "ix_messages_pending", "messages", ["created_at"], sqlite_where=sa.text("status = 'pending'"),
        postgresql_where=sa.text("status = 'pending'"),
    )  # fmt: skip
    op.create_index(
        "ix_a2a_tasks_open", "a2a_tasks", ["updated_at"],
        sqlite_where=sa.text("state IN ('submitted', 'working')"),
        postgresql_where=sa.text("state IN ('submitted', 'working')"),
    )  # fmt: skip
    op.create_index(
        "ix_subagent_sessions_open", "subagent_sessions", ["updated_at"],
        sqlite_where=sa.text("status IN ('queued', 'running')"),
        postgresql_where=sa.text("status IN ('queued', 'running')"),
    )  # fmt: skip


def downgrade() -> None:
    op.drop_index("ix_subagent_sessions_open", table_name="subagent_sessions")
    op.drop_index("ix_a2a_tasks_open", table_name="a2a_tasks")
    op.drop_index("ix_messages_pending", table_name="messages")
    for table in TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("lease_until")
