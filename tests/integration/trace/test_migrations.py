"""The Alembic migrations on both databases: upgrade from empty through 0001, 0002 (with rows in the
tables 0002 changes), 0003, 0004, 0005 (the same rows, renamed), 0006, 0007 and 0008, match the models,
downgrade step by step to base, upgrade again."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from agentmesh.services.trace.store.sql.db import create_engine, downgrade, migrate
from agentmesh.services.trace.store.sql.models import Base

TABLES = {"users", "api_keys", "agents", "peers", "traces", "messages", "a2a_tasks", "subagent_sessions"}
TABLES_0004 = TABLES - {"traces"} | {"sessions"}  # 0005 renames sessions to traces
AGENT_COLUMNS_0002 = {"owner_user_id", "version", "public", "created_at", "updated_at"}


@pytest.fixture
async def empty_engine(empty_database: str) -> AsyncIterator[AsyncEngine]:
    """An engine on a brand-new empty database."""
    engine = create_engine(empty_database)
    yield engine
    await engine.dispose()


async def _inspect(engine: AsyncEngine, fn: Any) -> Any:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: fn(inspect(c)))


async def _state(engine: AsyncEngine) -> tuple[set[str], list[object]]:
    """The tables, and the differences between the database and the models."""

    def read(conn):  # type: ignore[no-untyped-def]
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return set(inspect(conn).get_table_names()), compare_metadata(ctx, Base.metadata)

    async with engine.connect() as conn:
        return await conn.run_sync(read)


async def _revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: MigrationContext.configure(c).get_current_revision())


async def _columns(engine: AsyncEngine, table: str) -> set[str]:
    return {c["name"] for c in await _inspect(engine, lambda i: i.get_columns(table))}


async def _unique_names(engine: AsyncEngine, table: str) -> set[str]:
    """Unique constraints and unique indexes, by name."""
    constraints = await _inspect(engine, lambda i: i.get_unique_constraints(table))
    indexes = await _inspect(engine, lambda i: i.get_indexes(table))
    return {c["name"] for c in constraints} | {ix["name"] for ix in indexes if ix.get("unique")}


async def _rows(engine: AsyncEngine, sql: str, **params: Any) -> list[Any]:
    async with engine.connect() as conn:
        return list((await conn.execute(text(sql), params)).all())


async def _seed_0001(engine: AsyncEngine) -> None:
    """Rows as revision 0001 stores them: two catalog agents, a trace with an anchor and two subagents."""
    async with engine.begin() as conn:
        for sql in (
            "INSERT INTO users (name) VALUES ('alice')",
            "INSERT INTO agents (slug, name, description, model, config) VALUES"
            " ('general', 'General', '', 'mock-gpt', '{}'), ('coder', 'Coder', '', 'mock-gpt', '{}')",
            "INSERT INTO sessions (id, user_id, agent, kind, title)"
            " SELECT 't-1', id, 'general', 'chat', '' FROM users WHERE name = 'alice'",
            "INSERT INTO messages (session_id, sequence, role, content, thinking, model, input_tokens,"
            " output_tokens, sort_order, status)"
            " VALUES ('t-1', 1, 'assistant', '', '', '', 0, 0, 0, 'pending')",
            "INSERT INTO subagent_sessions (session_id, parent_message_id, parent_agent_id, source_type,"
            " preset_agent_id, name, goal, status, model, sort_order, batch_title)"
            " SELECT 't-1', m.id, g.id, 'preset', c.id, 'a', 'ga', 'queued', '', 0, ''"
            " FROM messages m, agents g, agents c WHERE g.slug = 'general' AND c.slug = 'coder'",
            "INSERT INTO subagent_sessions (session_id, parent_message_id, parent_agent_id, source_type,"
            " name, goal, status, model, sort_order, batch_title)"
            " SELECT 't-1', m.id, g.id, 'clone', 'b', 'gb', 'running', '', 1, ''"
            " FROM messages m, agents g WHERE g.slug = 'general'",
        ):
            await conn.execute(text(sql))


async def test_upgrade_downgrade_roundtrip(empty_engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Alembic config is found from any working directory
    assert await _revision(empty_engine) is None

    # 0001: the initial schema (agents unique by slug, subagents known by their integer key).
    await migrate(empty_engine, "0001")
    assert await _revision(empty_engine) == "0001"
    assert TABLES_0004 <= (await _state(empty_engine))[0]
    assert not AGENT_COLUMNS_0002 - {"created_at", "updated_at"} & await _columns(empty_engine, "agents")
    assert "public_id" not in await _columns(empty_engine, "subagent_sessions")
    assert "uq_agents_slug" in await _unique_names(empty_engine, "agents")
    await _seed_0001(empty_engine)

    # 0002 on a database with rows: agents become rows with an owner and a version, every existing
    # subagent gets a public id that cannot be enumerated.
    await migrate(empty_engine, "0002")
    assert await _revision(empty_engine) == "0002"
    assert AGENT_COLUMNS_0002 <= await _columns(empty_engine, "agents")
    agents = await _rows(empty_engine, "SELECT slug, owner_user_id, version, public FROM agents ORDER BY id")
    assert [tuple(r) for r in agents] == [("general", None, 1, 0), ("coder", None, 1, 0)]
    public_ids = [
        r[0] for r in await _rows(empty_engine, "SELECT public_id FROM subagent_sessions ORDER BY id")
    ]
    assert len(public_ids) == len(set(public_ids)) == 2
    assert all(re.fullmatch(r"[0-9a-f]{24}", p) for p in public_ids)
    assert {"uq_agents_owner_slug", "uq_agents_builtin_slug", "uq_subagent_sessions_public_id"} <= (
        await _unique_names(empty_engine, "agents") | await _unique_names(empty_engine, "subagent_sessions")
    )
    assert "uq_agents_slug" not in await _unique_names(empty_engine, "agents")
    indexes = {
        ix["name"] for ix in await _inspect(empty_engine, lambda i: i.get_indexes("subagent_sessions"))
    }
    assert {
        "idx_subagent_sessions_parent",
        "idx_subagent_sessions_status",
        "idx_subagent_sessions_agent",
    } <= indexes
    assert "idx_messages_source" in {
        ix["name"] for ix in await _inspect(empty_engine, lambda i: i.get_indexes("messages"))
    }
    # A slug is unique among built-ins and per owner; a user's own agent may share a built-in's slug.
    own = text(
        "INSERT INTO agents (slug, name, description, model, config, owner_user_id)"
        " VALUES ('coder', 'Mine', '', '', '{}', :owner)"
    )
    (alice,) = [r[0] for r in await _rows(empty_engine, "SELECT id FROM users")]
    async with empty_engine.begin() as conn:
        await conn.execute(own, {"owner": alice})
    for owner in (alice, None):
        with pytest.raises(IntegrityError):
            async with empty_engine.begin() as conn:
                await conn.execute(own, {"owner": owner})

    # 0003: leases on work in progress; a row of 0002 has none (its creation or last change counts).
    assert "lease_until" not in await _columns(empty_engine, "messages")
    await migrate(empty_engine, "0003")
    assert await _revision(empty_engine) == "0003"
    for table in ("messages", "a2a_tasks", "subagent_sessions"):
        assert "lease_until" in await _columns(empty_engine, table)
    assert (
        await _rows(empty_engine, "SELECT lease_until FROM subagent_sessions WHERE lease_until IS NOT NULL")
        == []
    )
    assert {"ix_messages_pending"} <= {
        ix["name"] for ix in await _inspect(empty_engine, lambda i: i.get_indexes("messages"))
    }
    # 0004: cached copies of peers' traces; every existing session is one of this mesh (home NULL).
    await migrate(empty_engine, "0004")
    assert await _revision(empty_engine) == "0004"
    assert {"home", "home_sequence", "synced_at"} <= await _columns(empty_engine, "sessions")
    assert await _rows(empty_engine, "SELECT id FROM sessions WHERE home IS NOT NULL") == []

    # 0005: one word, trace: the table and the columns that named a trace by a session are renamed,
    # with their indexes and constraints; the rows stay.
    await migrate(empty_engine, "0005")
    assert await _revision(empty_engine) == "0005"
    tables = (await _state(empty_engine))[0]
    assert TABLES <= tables and "sessions" not in tables
    assert {"trace_id", "caller_trace_id"} <= await _columns(empty_engine, "messages")
    assert {"trace_id", "caller_trace_id"} <= await _columns(empty_engine, "a2a_tasks")
    assert {"trace_id", "child_trace_id"} <= await _columns(empty_engine, "subagent_sessions")
    assert await _rows(empty_engine, "SELECT id, agent FROM traces") == [("t-1", "general")]
    assert [r[0] for r in await _rows(empty_engine, "SELECT trace_id FROM subagent_sessions")] == ["t-1"] * 2
    assert "uq_messages_trace_sequence" in await _unique_names(empty_engine, "messages")
    assert {"idx_traces_user_updated", "uq_traces_user_home"} <= {
        ix["name"] for ix in await _inspect(empty_engine, lambda i: i.get_indexes("traces"))
    }
    with pytest.raises(IntegrityError):  # the renamed unique constraint still holds
        async with empty_engine.begin() as conn:
            await conn.execute(
                text(
                    "INSERT INTO messages (trace_id, sequence, role, content, thinking, model, input_tokens,"
                    " output_tokens, sort_order, status)"
                    " VALUES ('t-1', 1, 'user', '', '', '', 0, 0, 0, 'completed')"
                )
            )
    # 0006: the end time of a run; the rows stay, without one.
    await migrate(empty_engine, "0006")
    assert await _revision(empty_engine) == "0006"
    assert await _rows(empty_engine, "SELECT count(*) FROM messages WHERE ended_at IS NOT NULL") == [(0,)]
    assert "ix_messages_runs" in {
        ix["name"] for ix in await _inspect(empty_engine, lambda i: i.get_indexes("messages"))
    }
    # 0007: a copied message's identity at home; NULL on every row of this mesh's own traces.
    await migrate(empty_engine, "0007")
    assert await _revision(empty_engine) == "0007"
    assert await _rows(empty_engine, "SELECT id FROM messages WHERE home_id IS NOT NULL") == []
    # 0008: a subagent row says whether it runs in the background; every older row does not.
    await migrate(empty_engine)
    assert await _revision(empty_engine) == "0008"
    tables, diff = await _state(empty_engine)
    assert TABLES <= tables and diff == []
    assert await _rows(empty_engine, "SELECT count(*) FROM subagent_sessions WHERE background") == [(0,)]
    await migrate(empty_engine)  # idempotent at head
    assert await _revision(empty_engine) == "0008"
    await downgrade(empty_engine, "0007")
    assert "background" not in await _columns(empty_engine, "subagent_sessions")
    await downgrade(empty_engine, "0006")
    assert "home_id" not in await _columns(empty_engine, "messages")
    await downgrade(empty_engine, "0005")
    assert "ended_at" not in await _columns(empty_engine, "messages")
    await downgrade(empty_engine, "0004")
    assert "traces" not in (await _state(empty_engine))[0]
    assert "session_id" in await _columns(empty_engine, "messages")
    assert await _rows(empty_engine, "SELECT id FROM sessions") == [("t-1",)]
    assert "uq_messages_session_sequence" in await _unique_names(empty_engine, "messages")
    await downgrade(empty_engine, "0003")
    assert "home" not in await _columns(empty_engine, "sessions")
    await downgrade(empty_engine, "0002")
    assert "lease_until" not in await _columns(empty_engine, "a2a_tasks")

    # Back to 0001: users' own agents go (0001 has no owners), the subagent rows stay.
    await downgrade(empty_engine, "0001")
    assert await _revision(empty_engine) == "0001"
    assert not AGENT_COLUMNS_0002 - {"created_at", "updated_at"} & await _columns(empty_engine, "agents")
    assert "public_id" not in await _columns(empty_engine, "subagent_sessions")
    assert "uq_agents_slug" in await _unique_names(empty_engine, "agents")
    assert [r[0] for r in await _rows(empty_engine, "SELECT slug FROM agents ORDER BY id")] == [
        "general",
        "coder",
    ]
    assert len(await _rows(empty_engine, "SELECT id FROM subagent_sessions")) == 2

    await downgrade(empty_engine)
    assert await _revision(empty_engine) is None
    assert (await _state(empty_engine))[0] & (TABLES | TABLES_0004) == set()

    await migrate(empty_engine)
    tables, diff = await _state(empty_engine)
    assert TABLES <= tables and diff == [] and await _revision(empty_engine) == "0008"
