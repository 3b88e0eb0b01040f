"""The Alembic migrations: upgrade from empty, match the models, downgrade to base, on both databases."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlparse

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import AsyncEngine

from services.trace.db import create_engine, downgrade, migrate
from services.trace.models import Base

TABLES = {"users", "api_keys", "agents", "peers", "sessions", "messages", "a2a_tasks", "subagent_sessions"}


@pytest.fixture(params=["sqlite", "postgres"])
async def empty_engine(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[AsyncEngine]:
    """An engine on a brand-new empty database."""
    if request.param == "sqlite":
        engine = create_engine(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}")
        yield engine
        await engine.dispose()
        return
    pg_url = request.getfixturevalue("pg_url")
    name = f"trace_mig_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        engine = create_engine(urlparse(pg_url)._replace(path=f"/{name}").geturl())
        yield engine
        await engine.dispose()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


async def _state(engine: AsyncEngine) -> tuple[set[str], list[object]]:
    def read(conn):  # type: ignore[no-untyped-def]
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return set(inspect(conn).get_table_names()), compare_metadata(ctx, Base.metadata)

    async with engine.connect() as conn:
        return await conn.run_sync(read)


async def test_upgrade_downgrade_roundtrip(empty_engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the Alembic config is found from any working directory
    await migrate(empty_engine)
    tables, diff = await _state(empty_engine)
    assert TABLES <= tables and diff == []
    indexes = {ix["name"] for ix in await _indexes(empty_engine, "subagent_sessions")}
    assert {
        "idx_subagent_sessions_parent",
        "idx_subagent_sessions_status",
        "idx_subagent_sessions_agent",
    } <= indexes
    assert "idx_messages_source" in {ix["name"] for ix in await _indexes(empty_engine, "messages")}

    await migrate(empty_engine)  # idempotent at head
    await downgrade(empty_engine)
    tables, _ = await _state(empty_engine)
    assert tables & TABLES == set()
    await migrate(empty_engine)
    assert TABLES <= (await _state(empty_engine))[0]


async def _indexes(engine: AsyncEngine, table: str) -> list[Any]:
    async with engine.connect() as conn:
        return await conn.run_sync(lambda c: inspect(c).get_indexes(table))
