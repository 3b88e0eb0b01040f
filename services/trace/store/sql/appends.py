"""Appending messages: the next sequence, the head and the row in one statement, and the appends that
arrive while one is being written, written together.

An append takes the trace's next sequence (`traces.last_sequence + 1`), follows the head (or the
parent it names; 0: a new root), and moves the head to itself: one statement for a whole batch on
PostgreSQL, a few in one transaction on SQLite (append_writes.py).

`AppendBatcher` collects appends: while a batch is in flight, new appends wait for the next one (at
most `max_flushes` batches at once, never two holding the same trace, which would only queue on its
row lock), so concurrent writers cost one transaction per batch instead of one each. An append that
finds nothing in flight is written at once. The result is the same as writing the items one after
another in arrival order: gap-free sequences per trace, each default append after the one before.
Items of one group (a turn's user message and placeholder) are written all or none. A batch that
fails is retried item group by item group, so one bad message fails only its own caller.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from agentmesh.libs.errors import InvalidArgument, MeshError, NotFound
from agentmesh.services.trace.store.sql.append_writes import Item, pg_write, sqlite_write
from agentmesh.services.trace.store.sql.common import MESSAGES, Database, now
from agentmesh.trace.v1 import trace_pb2 as tp

MAX_BATCH = 500  # items per statement
_M = MESSAGES


# ---- why an item was not written ---------------------------------------------------------------------


async def explain(db: Database, item: Item) -> MeshError:
    """The error of an item the batch left out (checked in the order a single append checks)."""

    async def work(conn: AsyncConnection) -> MeshError:
        try:
            await db.owned_trace(conn, item.owner, item.trace_id)
        except MeshError as err:
            return err
        if item.parent:
            hit = await conn.scalar(
                select(_M.c.id).where(_M.c.trace_id == item.trace_id, _M.c.sequence == item.parent)
            )
            if hit is None:
                return InvalidArgument(f"parent_sequence {item.parent} is not in the trace")
        return NotFound("trace not found")  # deleted while the batch ran

    return await db.run(work)


# ---- the batcher ---------------------------------------------------------------------------------------


class AppendBatcher:
    """Writes the appends of every caller, batched while a batch is in flight (see the module doc)."""

    def __init__(self, db: Database, *, max_flushes: int | None = None, max_batch: int = MAX_BATCH) -> None:
        self.db = db
        self.max_flushes = max_flushes or (1 if db.sqlite else 2)
        self.max_batch = max_batch
        self._pending: list[Item] = []
        self._busy: set[str] = set()  # traces a batch in flight holds
        self._flushes = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._groups = itertools.count(1)
        self._write: Callable[[AsyncConnection, Sequence[Item], datetime], Any] = (
            sqlite_write if db.sqlite else pg_write
        )

    async def append(self, items: Sequence[Item]) -> list[tp.Message]:
        """Writes `items` (of one trace, consecutively, all or none) and returns them as stored."""
        group = next(self._groups)
        for it in items:
            it.group = group
        self._enqueue(items)
        try:
            return [await it.future for it in items]
        except asyncio.CancelledError:
            for it in items:
                it.future.cancel()  # not written yet: it never will be
            raise

    async def append_each(self, items: Sequence[Item]) -> list[tp.Message | MeshError]:
        """Writes `items` in this order, each on its own (a group of its own: one that fails fails only
        itself): the stored message or the item's error, one per item. An error that is no item's own
        (the database went away) is raised once every item has its outcome."""
        for it in items:
            it.group = next(self._groups)
        self._enqueue(items)
        out: list[tp.Message | MeshError] = []
        failed: BaseException | None = None
        try:
            for it in items:
                try:
                    out.append(await it.future)
                except MeshError as err:
                    out.append(err)
                except Exception as exc:
                    failed = failed or exc
        except asyncio.CancelledError:
            for it in items:
                it.future.cancel()  # not written yet: it never will be
            raise
        if failed is not None:
            raise failed
        return out

    def _enqueue(self, items: Sequence[Item]) -> None:
        """Queues `items` for the next batch, and starts a flush when one may start and would take them."""
        self._pending.extend(items)
        if self._flushes < self.max_flushes and any(it.trace_id not in self._busy for it in items):
            self._flushes += 1
            task = asyncio.get_running_loop().create_task(self._flush())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[Item]:
        """The next batch: pending items of traces no batch in flight holds, in arrival order, up to
        `max_batch` items (a group is never split; a trace left out keeps all its later items out,
        so its order holds)."""
        batch: list[Item] = []
        rest: list[Item] = []
        held: set[str] = set(self._busy)
        for it in self._pending:
            if it.future.done():  # its caller gave up before it was written
                continue
            full = len(batch) >= self.max_batch and not (batch and batch[-1].group == it.group)
            if it.trace_id in held or full:
                held.add(it.trace_id)
                rest.append(it)
            else:
                batch.append(it)
        self._pending = rest
        self._busy |= {it.trace_id for it in batch}
        return batch

    async def _flush(self) -> None:
        try:
            while batch := self._take():
                try:
                    await self._write_batch(batch)
                finally:
                    self._busy -= {it.trace_id for it in batch}
        finally:
            self._flushes -= 1

    async def _write_batch(self, batch: list[Item]) -> None:
        stamp = now()
        try:
            written = await self.db.run(lambda conn: self._write(conn, batch, stamp), write=True)
        except Exception as exc:
            groups = list(_groups(batch))
            if len(groups) > 1:  # one bad message must not fail the others: each group on its own
                for group in groups:
                    await self._write_batch(group)
                return
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(exc)
            return
        left_out: dict[int, MeshError] = {}
        for index, it in enumerate(batch):
            if it.future.done():
                continue
            message = written.get(index)
            if message is not None:
                it.future.set_result(message)
                continue
            err = left_out.get(it.group)
            if err is None:
                mates = [m for m in batch if m.group == it.group]
                for mate in mates:
                    err = await explain(self.db, mate)
                    if not isinstance(err, NotFound) or mate is mates[-1]:
                        break
                assert err is not None
                left_out[it.group] = err
            it.future.set_exception(err)


def _groups(batch: list[Item]) -> list[list[Item]]:
    out: dict[int, list[Item]] = {}
    for it in batch:
        out.setdefault(it.group, []).append(it)
    return list(out.values())
