"""SQLite in the event loop (services/trace/store/sql/sqlite_inline.py): statements run in place, and a
lock another connection holds is waited for without blocking the loop (the holder's transaction, on
the same loop, ends meanwhile); past the busy timeout the statement fails as SQLite's would."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import text

from agentmesh.services.trace.store.sql import db as sql_db
from agentmesh.services.trace.store.sql.db import create_engine


async def _table(path: Path) -> None:
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)"))
    await engine.dispose()


async def test_a_write_waits_for_another_connections_lock_without_blocking_the_loop(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    await _table(path)
    holder, waiter = (create_engine(f"sqlite+aiosqlite:///{path}") for _ in range(2))
    try:
        async with holder.begin() as held:
            await held.execute(text("INSERT INTO t (v) VALUES ('first')"))  # holds the write lock

            async def second() -> None:
                async with waiter.begin() as conn:
                    await conn.execute(text("INSERT INTO t (v) VALUES ('second')"))

            waiting = asyncio.ensure_future(second())
            ticks = 0
            while ticks < 20:  # the loop runs on while the second write waits
                await asyncio.sleep(0.005)
                ticks += 1
            assert not waiting.done()
        await asyncio.wait_for(waiting, 5)  # the lock went with the first transaction
        async with waiter.connect() as conn:
            rows = (await conn.execute(text("SELECT v FROM t ORDER BY id"))).scalars().all()
        assert rows == ["first", "second"]
    finally:
        await holder.dispose()
        await waiter.dispose()


async def test_a_lock_held_past_the_busy_timeout_fails_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql_db, "BUSY_TIMEOUT_S", 0.2)
    path = tmp_path / "db.sqlite"
    await _table(path)
    outside = sqlite3.connect(path, isolation_level=None)  # another process's connection, in effect
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    try:
        outside.execute("BEGIN IMMEDIATE")
        with pytest.raises(Exception, match="database is locked"):
            async with engine.begin() as conn:
                await conn.execute(text("INSERT INTO t (v) VALUES ('refused')"))
        outside.execute("ROLLBACK")
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t (v) VALUES ('after')"))
        async with engine.connect() as conn:
            assert (await conn.execute(text("SELECT v FROM t"))).scalars().all() == ["after"]
    finally:
        outside.close()
        await engine.dispose()
