"""Initial schema: users, api keys, agents, peers, sessions, messages, A2A tasks, subagent sessions.

Revision ID: 0001
Revises:
Create Date: 2026-11-30 05:42:21.198353
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "agents",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("slug", sa.String(length=100), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agents")),
        sa.UniqueConstraint("slug", name=op.f("uq_agents_slug")),
    )
    op.create_table(
        "peers",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("alias", sa.String(length=100), nullable=False),
        sa.Column("url", sa.String(length=500), nullable=False),
        sa.Column("api_key", sa.String(length=500), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_peers")),
        sa.UniqueConstraint("alias", name=op.f("uq_peers_alias")),
    )
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_users")),
        sa.UniqueConstraint("name", name=op.f("uq_users_name")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_api_keys_user_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_user_id"), "api_keys", ["user_id"])

    op.create_table(
        "sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("agent", sa.String(length=100), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("visible_in_sidebar", sa.Integer(), server_default="0", nullable=False),
        sa.Column("head_sequence", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("last_sequence", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("title", sa.String(length=500), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_sessions_user_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_sessions")),
    )
    op.create_index("idx_sessions_user_updated", "sessions", ["user_id", "updated_at"])

    op.create_table(
        "a2a_tasks",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("user_id", sa.Integer(), nullable=False),
        sa.Column("caller_agent_id", sa.Integer(), nullable=True),
        sa.Column("caller_session_id", sa.String(length=64), nullable=True),
        sa.Column("caller_context", sa.JSON(), nullable=True),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("visible_in_sidebar", sa.Integer(), server_default="0", nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["caller_agent_id"],
            ["agents.id"],
            name=op.f("fk_a2a_tasks_caller_agent_id_agents"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["caller_session_id"],
            ["sessions.id"],
            name=op.f("fk_a2a_tasks_caller_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_a2a_tasks_session_id_sessions"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["user_id"], ["users.id"], name=op.f("fk_a2a_tasks_user_id_users"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_a2a_tasks")),
    )
    op.create_index(op.f("ix_a2a_tasks_caller_session_id"), "a2a_tasks", ["caller_session_id"])
    op.create_index(op.f("ix_a2a_tasks_session_id"), "a2a_tasks", ["session_id"])

    op.create_table(
        "messages",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("sequence", sa.BigInteger(), nullable=False),
        sa.Column("parent_sequence", sa.BigInteger(), nullable=True),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("thinking", sa.Text(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("input_tokens", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("sort_order", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("source", sa.String(length=10), server_default="user", nullable=False),
        sa.Column("a2a_task_id", sa.String(length=64), nullable=True),
        sa.Column("caller_agent_id", sa.Integer(), nullable=True),
        sa.Column("caller_session_id", sa.String(length=200), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["caller_agent_id"],
            ["agents.id"],
            name=op.f("fk_messages_caller_agent_id_agents"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"], ["sessions.id"], name=op.f("fk_messages_session_id_sessions"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_messages")),
        sa.UniqueConstraint("session_id", "sequence", name="uq_messages_session_sequence"),
    )
    op.create_index("idx_messages_source", "messages", ["source"])

    op.create_table(
        "subagent_sessions",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("parent_message_id", sa.BigInteger(), nullable=False),
        sa.Column("parent_tool_call_id", sa.String(length=200), nullable=True),
        sa.Column("parent_agent_id", sa.Integer(), nullable=True),
        sa.Column("source_type", sa.String(length=16), nullable=False),
        sa.Column("preset_agent_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("goal", sa.Text(), nullable=False),
        sa.Column("context", sa.Text(), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("tool_names", sa.JSON(), nullable=True),
        sa.Column("summary", sa.Text(), nullable=True),
        sa.Column("result_payload", sa.JSON(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("token_usage", sa.JSON(), nullable=True),
        sa.Column("sort_order", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("child_session_id", sa.String(length=64), nullable=True),
        sa.Column("batch_title", sa.String(length=500), nullable=False),
        sa.ForeignKeyConstraint(
            ["child_session_id"],
            ["sessions.id"],
            name=op.f("fk_subagent_sessions_child_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["parent_agent_id"],
            ["agents.id"],
            name=op.f("fk_subagent_sessions_parent_agent_id_agents"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["parent_message_id"],
            ["messages.id"],
            name=op.f("fk_subagent_sessions_parent_message_id_messages"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["preset_agent_id"],
            ["agents.id"],
            name=op.f("fk_subagent_sessions_preset_agent_id_agents"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["sessions.id"],
            name=op.f("fk_subagent_sessions_session_id_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_subagent_sessions")),
    )
    op.create_index("idx_subagent_sessions_agent", "subagent_sessions", ["parent_agent_id", "created_at"])
    op.create_index(
        "idx_subagent_sessions_parent", "subagent_sessions", ["session_id", "parent_message_id", "sort_order"]
    )
    op.create_index("idx_subagent_sessions_status", "subagent_sessions", ["session_id", "status"])
    op.create_index(op.f("ix_subagent_sessions_child_session_id"), "subagent_sessions", ["child_session_id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_subagent_sessions_child_session_id"), table_name="subagent_sessions")
    op.drop_index("idx_subagent_sessions_status", table_name="subagent_sessions")
    op.drop_index("idx_subagent_sessions_parent", table_name="subagent_sessions")
    op.drop_index("idx_subagent_sessions_agent", table_name="subagent_sessions")

    op.drop_table("subagent_sessions")
    op.drop_index("idx_messages_source", table_name="messages")

    op.drop_table("messages")
    op.drop_index(op.f("ix_a2a_tasks_session_id"), table_name="a2a_tasks")
    op.drop_index(op.f("ix_a2a_tasks_caller_session_id"), table_name="a2a_tasks")

    op.drop_table("a2a_tasks")
    op.drop_index("idx_sessions_user_updated", table_name="sessions")

    op.drop_table("sessions")
    op.drop_index(op.f("ix_api_keys_user_id"), table_name="api_keys")

    op.drop_table("api_keys")
    op.drop_table("users")
    op.drop_table("peers")
    op.drop_table("agents")
