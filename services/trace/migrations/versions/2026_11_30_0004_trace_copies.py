"""Cached copies of peers' traces (federation): a session row with `home` (the trace's
location-bearing id, `@alias/id`) is a copy of a trace that lives on that peer, owned by the user who
read it; `home_sequence` is the last of the peer's sequences it holds, `synced_at` when it was last
brought up to date. A copy is never listed in the sidebar and goes with its owner's data.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("home", sa.String(300), nullable=True))
        batch.add_column(sa.Column("home_sequence", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("synced_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "uq_sessions_user_home", "sessions", ["user_id", "home"], unique=True,
        sqlite_where=sa.text("home IS NOT NULL"), postgresql_where=sa.text("home IS NOT NULL"),
    )  # fmt: skip


def downgrade() -> None:
    op.drop_index("uq_sessions_user_home", table_name="sessions")
    with op.batch_alter_table("sessions") as batch:
        batch.drop_column("synced_at")
        batch.drop_column("home_sequence")
        batch.drop_column("home")
