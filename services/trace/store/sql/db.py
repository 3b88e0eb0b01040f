"""Engine, session factory and migrations of the trace database (SQLite via aiosqlite or PostgreSQL
via asyncpg)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from agentmesh.libs.files import private_file
from agentmesh.services.trace.store.sql import sqlite_inline

_OPERATIONS = frozenset({"select", "insert", "update", "delete", "with", "begin", "commit", "rollback"})
HERE = Path(__file__).resolve().parents[2]  # services/trace: alembic.ini and migrations/
_MIGRATION_LOCK = 0x6167_6D65  # pg advisory lock key: replicas starting together migrate one at a time
POOL_RECYCLE_S = 1800  # PostgreSQL connections older than this are replaced at their next checkout
BUSY_TIMEOUT_S = 10.0  # how long a SQLite statement waits for a lock another connection holds


def create_engine(url: str) -> AsyncEngine:
    """An async engine; SQLite connections run in the event loop (sqlite_inline: no thread hand-off per
    call), with foreign keys, WAL and a busy timeout.

    PostgreSQL connections are not pinged at every checkout (a round trip per unit of work, which
    PostgreSQL counts as a rollback): a connection the server has closed is known closed to asyncpg
    once the loop has read the server's goodbye, and is swapped for a fresh one at checkout, at no
    cost; old ones are recycled; and a unit of work that still meets a dead connection is retried
    once where that is safe (`common.Database.run`)."""
    if url.startswith(("postgres://", "postgresql://")):
        url = "postgresql+asyncpg://" + url.split("://", 1)[1]
    if url.startswith("sqlite"):
        path = make_url(url).database or ":memory:"
        if path != ":memory:" and not path.startswith("file:"):
            private_file(Path(path))  # 0600 before SQLite writes (its -wal and -shm files take its mode)
        engine = create_async_engine(url, async_creator=sqlite_inline.connector(path, BUSY_TIMEOUT_S))

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")  # WAL: durable at checkpoints, never corrupt
            cur.close()  # (a lock another connection holds is waited for by sqlite_inline, BUSY_TIMEOUT_S)

        return engine
    engine = create_async_engine(url, pool_size=10, max_overflow=20, pool_recycle=POOL_RECYCLE_S)

    @event.listens_for(engine.sync_engine, "checkout")
    def _alive(dbapi_conn: Any, _record: Any, _proxy: Any) -> None:
        if dbapi_conn.driver_connection.is_closed():
            raise DisconnectionError("the server closed this connection")  # the pool takes another

    return engine


def time_queries(engine: AsyncEngine, metrics: Any) -> None:
    """Times every statement of `engine` into `metrics.query_seconds` (a TraceStoreMetrics), by
    operation: select, insert, update, delete, with, or other."""

    @event.listens_for(engine.sync_engine, "before_cursor_execute")
    def _start(conn: Any, _cursor: Any, _statement: str, _params: Any, _context: Any, _many: bool) -> None:
        conn.info.setdefault("agentmesh_query_started", []).append(time.perf_counter())

    @event.listens_for(engine.sync_engine, "after_cursor_execute")
    def _end(conn: Any, _cursor: Any, statement: str, _params: Any, _context: Any, _many: bool) -> None:
        started = conn.info.get("agentmesh_query_started")
        if not started:
            return
        elapsed = time.perf_counter() - started.pop()
        word = statement.lstrip().split(None, 1)[0].lower() if statement.strip() else ""
        metrics.query_seconds.labels(word if word in _OPERATIONS else "other").observe(elapsed)

    @event.listens_for(engine.sync_engine, "handle_error")
    def _failed(context: Any) -> None:
        conn = context.connection
        if conn is not None and conn.info.get("agentmesh_query_started"):
            conn.info["agentmesh_query_started"].pop()


def session_factory(engine: AsyncEngine) -> async_sessionmaker:  # type: ignore[type-arg]
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config() -> Config:
    """The Alembic config inside this package: works from any cwd and from an installed package."""
    return Config(str(HERE / "alembic.ini"))


def _run(conn: Connection, action: str, revision: str) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = conn
    getattr(command, action)(cfg, revision)


async def _migrate(engine: AsyncEngine, action: str, revision: str) -> None:
    async with engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            # SQLite alters a table by copying it and dropping the old one: with foreign keys on, that drop
            # would cascade into every referencing row. Off for the migration (outside its transaction).
            await conn.exec_driver_sql("PRAGMA foreign_keys=OFF")
            await conn.commit()
        async with conn.begin():
            if conn.dialect.name == "postgresql":
                await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
            await conn.run_sync(_run, action, revision)
        if conn.dialect.name == "sqlite":
            await conn.exec_driver_sql("PRAGMA foreign_keys=ON")
            await conn.commit()


async def migrate(engine: AsyncEngine, revision: str = "head") -> None:
    """`alembic upgrade <revision>` on this engine."""
    await _migrate(engine, "upgrade", revision)


async def downgrade(engine: AsyncEngine, revision: str = "base") -> None:
    """`alembic downgrade <revision>` on this engine."""
    await _migrate(engine, "downgrade", revision)
