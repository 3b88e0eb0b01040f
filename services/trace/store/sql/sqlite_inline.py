"""SQLite in the trace service's own event loop: an aiosqlite-shaped connection (what SQLAlchemy's
`sqlite+aiosqlite` dialect drives) that runs each sqlite3 call in place.

aiosqlite hands every call (cursor, execute, fetch, close, commit) to a thread of its own and back,
and each hand-off wakes two threads: a turn's few statements made some thirty of them. SQLite in WAL
mode answers from its page cache in microseconds, and the trace service writes one transaction at a
time (`Database.write_lock`), so the calls run in place instead. What must not block the loop is
waiting for a lock another connection holds (another process on the file, or a second engine of this
one, whose transaction may need this very loop to end): SQLite's own busy handler is off on these
connections, and a statement that finds the database locked is retried here after an asynchronous
pause, up to `busy_timeout_s`, as that handler would.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")
FIRST_PAUSE_S = 0.001
MAX_PAUSE_S = 0.05


def _locked(exc: sqlite3.OperationalError) -> bool:
    message = str(exc)
    return message.startswith(("database is locked", "database table is locked"))


class Cursor:
    """An aiosqlite.Cursor: the sqlite3 cursor's calls, awaitable."""

    def __init__(self, connection: Connection, cursor: sqlite3.Cursor) -> None:
        self._connection = connection
        self._cursor = cursor

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount

    @property
    def lastrowid(self) -> int | None:
        return self._cursor.lastrowid

    @property
    def arraysize(self) -> int:
        return self._cursor.arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._cursor.arraysize = value

    async def execute(self, sql: str, parameters: Any = ()) -> Cursor:
        await self._connection.patiently(lambda: self._cursor.execute(sql, parameters))
        return self

    async def executemany(self, sql: str, parameters: Iterable[Any]) -> Cursor:
        rows = list(parameters)  # retried whole: a generator would be spent by the first try
        await self._connection.patiently(lambda: self._cursor.executemany(sql, rows))
        return self

    async def fetchone(self) -> Any:
        return self._cursor.fetchone()

    async def fetchmany(self, size: int | None = None) -> list[Any]:
        return self._cursor.fetchmany(size) if size is not None else self._cursor.fetchmany()

    async def fetchall(self) -> list[Any]:
        return self._cursor.fetchall()

    async def close(self) -> None:
        self._cursor.close()

    async def __aenter__(self) -> Cursor:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


class _InPlace:
    """aiosqlite's queue of calls for its thread, as SQLAlchemy's dialect uses it (to set the
    isolation level): each call runs at once."""

    def put_nowait(self, item: tuple[asyncio.Future[Any] | None, Callable[[], Any]]) -> None:
        future, function = item
        try:
            result = function()
        except BaseException as exc:
            if future is not None:
                future.set_exception(exc)
            return
        if future is not None:
            future.set_result(result)


class Connection:
    """An aiosqlite.Connection whose calls run in place (see the module's docstring)."""

    def __init__(self, conn: sqlite3.Connection, busy_timeout_s: float) -> None:
        self._conn = conn
        self._connection: sqlite3.Connection | None = conn  # None once closed (SQLAlchemy checks it)
        self._tx = _InPlace()
        self.busy_timeout_s = busy_timeout_s

    async def patiently(self, call: Callable[[], T]) -> T:
        """`call()`, again after a pause while another connection holds the lock it needs."""
        deadline = time.monotonic() + self.busy_timeout_s
        pause = FIRST_PAUSE_S
        while True:
            try:
                return call()
            except sqlite3.OperationalError as exc:
                if not _locked(exc) or time.monotonic() + pause > deadline:
                    raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, MAX_PAUSE_S)

    @property
    def isolation_level(self) -> str | None:
        return self._conn.isolation_level

    def cursor(self) -> Cursor:
        return Cursor(self, self._conn.cursor())

    async def execute(self, sql: str, parameters: Any = ()) -> Cursor:
        return await self.cursor().execute(sql, parameters)

    async def commit(self) -> None:
        await self.patiently(self._conn.commit)

    async def rollback(self) -> None:
        self._conn.rollback()

    async def close(self) -> None:
        if self._connection is not None:
            self._connection = None
            self._conn.close()

    def stop(self) -> None:
        """Terminates the connection (SQLAlchemy's terminate)."""
        if self._connection is not None:
            self._connection = None
            self._conn.close()

    async def create_function(self, *args: Any, **kwargs: Any) -> None:
        self._conn.create_function(*args, **kwargs)


def connector(path: str, busy_timeout_s: float) -> Callable[[], Awaitable[Connection]]:
    """What `create_async_engine(..., async_creator=)` takes: a new in-place connection to `path`
    (as pysqlite would open it; SQLite's busy handler off: `Connection.patiently` waits instead)."""

    async def connect() -> Connection:
        conn = sqlite3.connect(path, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout=0")
        return Connection(conn, busy_timeout_s)

    return connect
