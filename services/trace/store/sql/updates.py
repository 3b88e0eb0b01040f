"""Message updates: on PostgreSQL one statement built once per set of columns (`pg_update_of`); on
SQLite written together while one is being written.

An update sets some columns of one message of a trace its caller owns and moves that trace's
`updated_at`; the caller gets the row as stored, or NotFound for a message that is missing or not
theirs (the same answer). On PostgreSQL that is one statement (`SqlTraceStore.update_message`). On
SQLite it is three statements and a transaction under the process's single writer, so updates that
arrive together (a fan-out's children ending at once) would queue one transaction after another.

`UpdateBatcher` collects them as `AppendBatcher` collects appends: while a batch is in flight, new
updates wait for the next one; one that finds nothing in flight is written at once. A batch is one
transaction of a few statements: one executemany UPDATE per set of columns changed (the owner check
in its WHERE), one SELECT of every updated row by id with the owner, one UPDATE of the touched traces'
`updated_at`. A message is in at most one item of a batch (a later update of it waits for the next
batch), so updates of one message apply in arrival order and each caller reads back its own. A batch
that fails is retried item by item, so one bad update fails only its own caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Row, bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from agentmesh.libs.errors import NotFound
from agentmesh.services.trace.store.sql.common import (
    AGENTS,
    MESSAGES,
    TRACES,
    USERS,
    Database,
    chunks,
    in_owned_trace,
    message_columns,
    message_from_row,
    now,
    owned_by_param,
)
from agentmesh.trace.v1 import trace_pb2 as tp

MAX_BATCH = 500  # items per batch (ids per IN clause)
_M, _S, _A, _U = MESSAGES, TRACES, AGENTS, USERS


@dataclass(eq=False)
class Update:
    """One message update: the columns to set (checked by the caller) of message `message_id`."""

    owner: str
    message_id: int
    values: dict[str, Any]
    future: asyncio.Future[tp.Message] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def key(self) -> tuple[str, ...]:
        return tuple(sorted(self.values))

    def params(self) -> dict[str, Any]:
        """The bind parameters of `_update_of(self.key)` (and of `pg_update_of`)."""
        return {
            "u_id": self.message_id,
            "u_owner": self.owner,
            **{f"v_{c}": v for c, v in self.values.items()},
        }


_UPDATES: dict[tuple[str, ...], Any] = {}  # columns -> the executemany UPDATE setting them


def _update_of(key: tuple[str, ...]) -> Any:
    stmt = _UPDATES.get(key)
    if stmt is None:
        stmt = (
            update(_M)
            .where(_M.c.id == bindparam("u_id"), in_owned_trace(_M.c.trace_id, owned_by_param("u_owner")))
            .values({c: bindparam(f"v_{c}", type_=_M.c[c].type) for c in key})
        )
        _UPDATES[key] = stmt
    return stmt


_PG_UPDATES: dict[tuple[str, ...], Any] = {}  # columns -> pg_update_of's statement


def pg_update_of(key: tuple[str, ...]) -> Any:
    """The update of columns `key` on PostgreSQL, as one statement built once per set of columns: the
    message (its owner checked as `_update_of` does), its trace's `updated_at` (`:now`), and the row
    read back with its caller agent's slug (`Update.params()` and `now` bind it)."""
    stmt = _PG_UPDATES.get(key)
    if stmt is None:
        changed = _update_of(key).returning(*_M.c).cte("changed")
        touched = (
            update(_S).where(_S.c.id.in_(select(changed.c.trace_id))).values(updated_at=bindparam("now"))
        )
        stmt = (
            select(*message_columns(changed))
            .select_from(changed.outerjoin(_A, _A.c.id == changed.c.caller_agent_id))
            .add_cte(touched.cte("touched"))
        )
        _PG_UPDATES[key] = stmt
    return stmt


_ROWS = (
    select(*message_columns(), _U.c.name.label("owner_name"))
    .select_from(
        _M.outerjoin(_A, _A.c.id == _M.c.caller_agent_id)
        .join(_S, _S.c.id == _M.c.trace_id)
        .join(_U, _U.c.id == _S.c.user_id)
    )
    .where(_M.c.id.in_(bindparam("ids", expanding=True)), _S.c.deleted_at.is_(None))
)
_TOUCH = update(_S).where(_S.c.id.in_(bindparam("sids", expanding=True))).values(updated_at=bindparam("now"))


async def sqlite_update(
    conn: AsyncConnection, items: Sequence[Update], stamp: datetime
) -> dict[int, Row[Any]]:
    """Writes `items` (each of another message) in the caller's transaction: index in `items` -> the
    row as stored, for every item whose message its owner owns."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for it in items:
        groups.setdefault(it.key, []).append(it.params())
    for key, rows in groups.items():
        await conn.execute(_update_of(key), rows)
    found: dict[int, Row[Any]] = {}
    for ids in chunks(sorted({it.message_id for it in items})):
        found.update({r.id: r for r in await conn.execute(_ROWS, {"ids": ids})})
    out = {
        index: found[it.message_id]
        for index, it in enumerate(items)
        if it.message_id in found and found[it.message_id].owner_name == it.owner
    }
    touched = sorted({row.trace_id for row in out.values()})
    for sids in chunks(touched):
        await conn.execute(_TOUCH, {"sids": sids, "now": stamp})
    return out


class UpdateBatcher:
    """Writes the message updates of every caller, batched while a batch is in flight (see the
    module doc). SQLite only: it has one writer per process."""

    def __init__(self, db: Database, *, max_batch: int = MAX_BATCH) -> None:
        self.db = db
        self.max_batch = max_batch
        self._pending: list[Update] = []
        self._flushing = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def update(self, item: Update) -> tp.Message:
        """Writes `item` and returns its message as stored (NotFound: missing or not the owner's)."""
        self._pending.append(item)
        if not self._flushing:
            self._flushing = True
            task = asyncio.get_running_loop().create_task(self._flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        try:
            return await item.future
        except asyncio.CancelledError:
            item.future.cancel()  # not written yet: it never will be (a batch in flight goes on)
            raise

    def _take(self) -> list[Update]:
        """The next batch: pending items in arrival order, one per message (a later update of a message
        waits for the next batch, and keeps its own later ones behind it), up to `max_batch`."""
        batch: list[Update] = []
        rest: list[Update] = []
        held: set[int] = set()
        for it in self._pending:
            if it.future.done():  # its caller gave up before it was written
                continue
            if it.message_id in held or len(batch) >= self.max_batch:
                rest.append(it)
            else:
                batch.append(it)
            held.add(it.message_id)
        self._pending = rest
        return batch

    async def _flush(self) -> None:
        try:
            while batch := self._take():
                try:
                    await self._write_batch(batch)
                except Exception as exc:  # not the database's (those are the items'): still an answer each
                    for it in batch:
                        if not it.future.done():
                            it.future.set_exception(exc)
        finally:
            self._flushing = False

    async def _write_batch(self, batch: list[Update]) -> None:
        stamp = now()
        try:
            written = await self.db.run(lambda conn: sqlite_update(conn, batch, stamp), write=True)
        except Exception as exc:
            if len(batch) > 1:  # one bad update must not fail the others: each on its own
                for it in batch:
                    if not it.future.done():
                        await self._write_batch([it])
                return
            if not batch[0].future.done():
                batch[0].future.set_exception(exc)
            return
        for index, it in enumerate(batch):
            if it.future.done():
                continue
            row = written.get(index)
            if row is None:
                it.future.set_exception(NotFound("message not found"))
            else:
                it.future.set_result(message_from_row(row))
