"""Agents are rows with an owner and a version (built-ins: owner NULL); subagents get ids that cannot
be enumerated (`public_id`), the integer key stays internal.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 16:00:00
"""

import secrets
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agents") as batch:
        batch.drop_constraint("uq_agents_slug", type_="unique")
        batch.add_column(sa.Column("owner_user_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("version", sa.BigInteger(), server_default="1", nullable=False))
        batch.add_column(sa.Column("public", sa.Integer(), server_default="0", nullable=False))
        batch.add_column(
            sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)
        )
        batch.add_column(
            sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False)
        )
        batch.create_foreign_key(
            "fk_agents_owner_user_id_users", "users", ["owner_user_id"], ["id"], ondelete="CASCADE"
        )
        batch.create_unique_constraint("uq_agents_owner_slug", ["owner_user_id", "slug"])
    op.create_index(
        "uq_agents_builtin_slug",
        "agents",
        ["slug"],
        unique=True,
        sqlite_where=sa.text("owner_user_id IS NULL"),
        postgresql_where=sa.text("owner_user_id IS NULL"),
    )

    with op.batch_alter_table("subagent_sessions") as batch:
        batch.add_column(sa.Column("public_id", sa.String(length=32), nullable=True))
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT id FROM subagent_sessions")).fetchall()
    for (row_id,) in rows:
        conn.execute(
            sa.text("UPDATE subagent_sessions SET public_id = :p WHERE id = :i"),
            {"p": secrets.token_hex(12), "i": row_id},
        )
    with op.batch_alter_table("subagent_sessions") as batch:
        batch.alter_column("public_id", existing_type=sa.String(length=32), nullable=False)
        batch.create_unique_constraint("uq_subagent_sessions_public_id", ["public_id"])


def downgrade() -> None:
    with op.batch_alter_table("subagent_sessions") as batch:
        batch.drop_constraint("uq_subagent_sessions_public_id", type_="unique")
        batch.drop_column("public_id")
    op.drop_index("uq_agents_builtin_slug", table_name="agents")
    op.execute("DELETE FROM agents WHERE owner_user_id IS NOT NULL")
    with op.batch_alter_table("agents") as batch:
        batch.drop_constraint("uq_agents_owner_slug", type_="unique")
        batch.drop_constraint("fk_agents_owner_user_id_users", type_="foreignkey")
        batch.drop_column("updated_at")
        batch.drop_column("created_at")
        batch.drop_column("public")
        batch.drop_column("version")
        batch.drop_column("owner_user_id")
        batch.create_unique_constraint("uq_agents_slug", ["slug"])
