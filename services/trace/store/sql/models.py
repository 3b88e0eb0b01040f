"""The trace database schema (SQLAlchemy 2 typed models); the migrations in `migrations/` create it."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# None is stored as SQL NULL, not the JSON literal null.
NullableJSON = JSON(none_as_null=True)
# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets BIGINT identities.
BigId = BigInteger().with_variant(Integer(), "sqlite")

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


def _created() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


class User(Base):
    __tablename__ = "users"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = _created()


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the key
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = _created()
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class AgentRow(Base):
    """An agent: a built-in one of the catalog (owner NULL, slug unique among built-ins) or a user's own
    (slug unique per owner). `config` holds the agent as its camelCase JSON; `version` grows on change."""

    __tablename__ = "agents"
    __table_args__ = (
        UniqueConstraint("owner_user_id", "slug", name="uq_agents_owner_slug"),
        Index(
            "uq_agents_builtin_slug",
            "slug",
            unique=True,
            sqlite_where=text("owner_user_id IS NULL"),
            postgresql_where=text("owner_user_id IS NULL"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    slug: Mapped[str] = mapped_column(String(100))
    name: Mapped[str] = mapped_column(String(200))
    description: Mapped[str] = mapped_column(Text, default="")
    model: Mapped[str] = mapped_column(String(200), default="")
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    owner_user_id: Mapped[int | None] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    version: Mapped[int] = mapped_column(BigInteger, default=1, server_default="1")
    public: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class Peer(Base):
    __tablename__ = "peers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    alias: Mapped[str] = mapped_column(String(100), unique=True)
    url: Mapped[str] = mapped_column(String(500))
    api_key: Mapped[str] = mapped_column(String(500), default="")
    created_at: Mapped[datetime] = _created()


class TraceRow(Base):
    """A trace (a chat session in the sidebar is one). `last_sequence` is the allocation counter;
    `head_sequence` the branch tip."""

    __tablename__ = "traces"
    __table_args__ = (
        Index("idx_traces_user_updated", "user_id", "updated_at"),
        Index(
            "uq_traces_user_home",
            "user_id",
            "home",
            unique=True,
            sqlite_where=text("home IS NOT NULL"),
            postgresql_where=text("home IS NOT NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    agent: Mapped[str] = mapped_column(String(100), default="")
    kind: Mapped[str] = mapped_column(String(16), default="chat")
    visible_in_sidebar: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    head_sequence: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    last_sequence: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    title: Mapped[str] = mapped_column(String(500), default="")
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # A cached copy of a peer's trace (federation): its location-bearing id, the last of the peer's
    # sequences it holds, and when it was last brought up to date. NULL home: a trace of this mesh.
    home: Mapped[str | None] = mapped_column(String(300))
    home_sequence: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    synced_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class MessageRow(Base):
    __tablename__ = "messages"
    __table_args__ = (
        UniqueConstraint("trace_id", "sequence", name="uq_messages_trace_sequence"),
        Index("idx_messages_source", "source"),
        Index(
            "ix_messages_pending",
            "created_at",
            sqlite_where=text("status = 'pending'"),
            postgresql_where=text("status = 'pending'"),
        ),
        Index(
            "ix_messages_runs",
            "created_at",
            "id",
            sqlite_where=text("role = 'assistant'"),
            postgresql_where=text("role = 'assistant'"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    trace_id: Mapped[str] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"))
    sequence: Mapped[int] = mapped_column(BigInteger)
    parent_sequence: Mapped[int | None] = mapped_column(BigInteger)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text, default="")
    thinking: Mapped[str] = mapped_column(Text, default="")
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", NullableJSON)
    model: Mapped[str] = mapped_column(String(200), default="")
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    sort_order: Mapped[int] = mapped_column(BigInteger, default=0)
    status: Mapped[str] = mapped_column(String(16), default="completed")
    source: Mapped[str] = mapped_column(String(10), default="user", server_default="user")
    a2a_task_id: Mapped[str | None] = mapped_column(String(64))
    caller_agent_id: Mapped[int | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"))
    caller_trace_id: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = _created()
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # of a pending one
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # when it left pending
    # A message of a cached copy (docs/federation.md#what-a-copy-shows): its id and caller agent at home.
    home_id: Mapped[int | None] = mapped_column(BigInteger)
    home_caller_agent: Mapped[str | None] = mapped_column(String(100))

    caller_agent: Mapped[AgentRow | None] = relationship(lazy="joined")


class A2ATaskRow(Base):
    """The task row (docs/requirements.md#invoke-task-rows): the task and the callee's hidden trace."""

    __tablename__ = "a2a_tasks"
    __table_args__ = (
        Index(
            "ix_a2a_tasks_open",
            "updated_at",
            sqlite_where=text("state IN ('submitted', 'working')"),
            postgresql_where=text("state IN ('submitted', 'working')"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    trace_id: Mapped[str] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), index=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"))
    caller_agent_id: Mapped[int | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"))
    caller_trace_id: Mapped[str | None] = mapped_column(
        ForeignKey("traces.id", ondelete="CASCADE"), index=True
    )
    caller_context: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON)
    state: Mapped[str] = mapped_column(String(20), default="submitted")
    visible_in_sidebar: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    trace: Mapped[TraceRow] = relationship(foreign_keys=[trace_id], lazy="joined", innerjoin=True)
    caller_agent: Mapped[AgentRow | None] = relationship(lazy="joined")


class SubagentRow(Base):
    """One delegated subagent (docs/requirements.md#subagent-rows), anchored on its supervisor's
    assistant message."""

    __tablename__ = "subagent_sessions"
    __table_args__ = (
        Index("idx_subagent_sessions_parent", "trace_id", "parent_message_id", "sort_order"),
        Index("idx_subagent_sessions_status", "trace_id", "status"),
        Index("idx_subagent_sessions_agent", "parent_agent_id", "created_at"),
        Index(
            "ix_subagent_sessions_open",
            "updated_at",
            sqlite_where=text("status IN ('queued', 'running')"),
            postgresql_where=text("status IN ('queued', 'running')"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    public_id: Mapped[str] = mapped_column(String(32), unique=True)  # the id callers see: not guessable
    trace_id: Mapped[str] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"))
    parent_message_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("messages.id", ondelete="CASCADE"))
    parent_tool_call_id: Mapped[str | None] = mapped_column(String(200))
    parent_agent_id: Mapped[int | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"))
    source_type: Mapped[str] = mapped_column(String(16), default="preset")
    preset_agent_id: Mapped[int | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"))
    name: Mapped[str] = mapped_column(String(200), default="")
    goal: Mapped[str] = mapped_column(Text, default="")
    context: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    model: Mapped[str] = mapped_column(String(200), default="")
    tool_names: Mapped[list[str] | None] = mapped_column(NullableJSON)
    summary: Mapped[str | None] = mapped_column(Text)
    result_payload: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON)
    error: Mapped[str | None] = mapped_column(Text)
    token_usage: Mapped[dict[str, Any] | None] = mapped_column(NullableJSON)
    sort_order: Mapped[int] = mapped_column(Integer, default=0)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()
    child_trace_id: Mapped[str | None] = mapped_column(
        ForeignKey("traces.id", ondelete="CASCADE"), index=True
    )
    batch_title: Mapped[str] = mapped_column(String(500), default="")
    # a background child (docs/agents.md#background-subagents): its supervisor's call did not wait
    background: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    lease_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    parent_agent: Mapped[AgentRow | None] = relationship(foreign_keys=[parent_agent_id], lazy="joined")
    preset_agent: Mapped[AgentRow | None] = relationship(foreign_keys=[preset_agent_id], lazy="joined")
