"""When a run ended: `messages.ended_at`, stamped when an assistant placeholder leaves pending (the
list of runs, docs/http-api.md#runs, shows it), and a partial index on the assistant messages by
creation time, which that list reads newest first.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04 19:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_messages_runs", "messages", ["created_at", "id"], sqlite_where=sa.text("role = 'assistant'"),
        postgresql_where=sa.text("role = 'assistant'"),
    )  # fmt: skip


def downgrade() -> None:
    op.drop_index("ix_messages_runs", table_name="messages")
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("ended_at")
