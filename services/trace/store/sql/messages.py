"""Messages in SQL: appends (sequences allocated under the trace's row lock, batched: appends.py),
updates (one statement on PostgreSQL, batched on SQLite: updates.py), reads of the main path or every
branch."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from sqlalchemy import ColumnElement, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from agentmesh.libs.errors import AlreadyExists, InvalidArgument, MeshError, NotFound
from agentmesh.services.trace.store.base import Append, MessagePage, MessageQuery, MessageStore, each_apart
from agentmesh.services.trace.store.sql.append_writes import (
    Item,
    make_item,
    pg_write,
    sqlite_write,
    write_first,
)
from agentmesh.services.trace.store.sql.appends import AppendBatcher
from agentmesh.services.trace.store.sql.common import (
    MESSAGE_COLUMNS,
    MESSAGES,
    MESSAGES_WITH_AGENT,
    MSG_STATUS,
    TRACES,
    Database,
    from_struct,
    in_owned_trace,
    message_from_row,
    name_of,
    now,
    trace_pb,
)
from agentmesh.services.trace.store.sql.traces import MAIN_PATH, new_trace_row
from agentmesh.services.trace.store.sql.updates import Update, UpdateBatcher, pg_update_of
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp


class SqlMessageStore(MessageStore):
    def __init__(self, db: Database) -> None:
        self.db = db
        self.appends = AppendBatcher(db)
        self.updates = UpdateBatcher(db)

    async def append_message(
        self, owner: str, message: tp.Message, parent_sequence: int | None = None
    ) -> tp.Message:
        (out,) = await self.appends.append([make_item(owner, message, parent_sequence)])
        return out

    async def append_each(self, appends: Sequence[Append]) -> list[tp.Message | MeshError]:
        """Every append into the batcher at once, so that they are written together."""
        return await each_apart(
            appends, lambda a: make_item(a.owner, a.message, a.parent_sequence), self.appends.append_each
        )

    async def append_messages(
        self,
        owner: str,
        trace_id: str,
        messages: Sequence[tp.Message],
        parent_sequence: int | None = None,
    ) -> list[tp.Message]:
        items = self._items(owner, trace_id, messages, parent_sequence)
        return await self.appends.append(items)

    @staticmethod
    def _items(
        owner: str, trace_id: str, messages: Sequence[tp.Message], parent_sequence: int | None
    ) -> list[Item]:
        return [
            make_item(owner, m, parent_sequence if i == 0 else None, trace_id) for i, m in enumerate(messages)
        ]

    async def create_trace_with_messages(
        self, owner: str, trace: tp.Trace, trace_id: str, messages: Sequence[tp.Message]
    ) -> tuple[tp.Trace, list[tp.Message]]:
        """A new trace and its first messages, in one transaction (nothing when any is refused)."""
        row = new_trace_row(0, trace, trace_id, now())
        items = self._items(owner, row.id, messages, None)
        # Core statements in one transaction (a turn's set-up waits for it: no ORM unit of work). The
        # trace is new: its row is inserted with its counter and head at the last message, and the
        # messages in one INSERT, unless one names a caller agent (looked up by the general write).
        first = not any(it.message.caller_agent for it in items)
        write = write_first if first else sqlite_write if self.db.sqlite else pg_write
        async with self.db.write_lock, self.db.engine.begin() as conn:
            stamp = row.created_at = row.updated_at = now()
            row.user_id = await self.db.user_id(conn, owner)
            row.last_sequence = row.head_sequence = len(items) if first else 0
            values = {c.key: getattr(row, c.key) for c in TRACES.columns if getattr(row, c.key) is not None}
            try:
                await conn.execute(TRACES.insert(), values)  # not .values(): a cache key per call
            except IntegrityError as exc:
                raise AlreadyExists("trace already exists") from exc
            written = await write(conn, items, stamp)
        # A new trace of the caller's, default parents: every message is written.
        stored = [written[i] for i in range(len(items))]
        out = trace_pb(row, owner)
        out.head_sequence = stored[-1].sequence
        return out, stored

    async def update_message(self, owner: str, message: tp.Message, fields: Collection[str]) -> tp.Message:
        values: dict[str, Any] = {}
        if "content" in fields:
            values["content"] = message.content
        if "thinking" in fields:
            values["thinking"] = message.thinking
        if "metadata" in fields:
            values["metadata"] = from_struct(message, "metadata")
        if "model" in fields:
            values["model"] = message.model
        if "usage" in fields:
            values["input_tokens"] = message.usage.input_tokens
            values["output_tokens"] = message.usage.output_tokens
        if "status" in fields:
            values["status"] = name_of(MSG_STATUS, message.status, "message status")
            if message.status != tp.MESSAGE_STATUS_PENDING:  # the run's end (its final status)
                values["ended_at"] = now()
        item = Update(owner, message.id, values)
        if self.db.sqlite:  # concurrent updates in one transaction (its single writer)
            return await self.updates.update(item)
        statement, params = pg_update_of(item.key), {**item.params(), "now": now()}

        async def pg(conn: AsyncConnection) -> Any:
            return (await conn.execute(statement, params)).first()

        row = await self.db.run(pg, write=True)
        if row is None:
            raise NotFound("message not found")
        return message_from_row(row)

    async def get_message(self, owner: str, message_id: int) -> tp.Message:
        stmt = _MESSAGES.where(_M.c.id == message_id, in_owned_trace(_M.c.trace_id, self.db.owned(owner)))

        async def work(conn: AsyncConnection) -> Any:
            return (await conn.execute(stmt)).first()

        row = await self.db.run(work)
        if row is None:
            raise NotFound("message not found")
        return message_from_row(row)

    async def list_messages(self, owner: str, query: MessageQuery) -> MessagePage:

        async def has(conn: AsyncConnection, trace_id: str, sequence: int) -> bool:
            found = await conn.scalar(
                select(_M.c.id).where(_M.c.trace_id == trace_id, _M.c.sequence == sequence)
            )
            return found is not None

        async def work(conn: AsyncConnection) -> MessagePage:
            trace = await self.db.owned_trace(conn, owner, query.trace_id)
            head = query.head_sequence or trace.head_sequence
            where: list[ColumnElement[bool]] = [
                _M.c.trace_id == trace.id,
                _M.c.sequence > query.since_sequence,
            ]
            params: dict[str, Any] = {}
            if query.mode == ms.PATH_MODE_ALL:
                # Every branch is listed whatever the head, but an unknown head is an error in both
                # modes, on every page (main path mode finds out below, from an empty page).
                if query.head_sequence and not await has(conn, trace.id, query.head_sequence):
                    raise InvalidArgument(f"head_sequence {query.head_sequence} is not in the trace")
            else:
                if not head:
                    return MessagePage([], 0, 0)
                where.append(_M.c.sequence.in_(MAIN_PATH))
                params = {"sid": trace.id, "head": head}
            # One query: the page, and the total before limit/offset as a window count.
            total_col = func.count().over().label("total")
            result = await conn.execute(
                _MESSAGES.add_columns(total_col)
                .where(*where)
                .order_by(_M.c.sequence)
                .offset(query.offset)
                .limit(query.limit),
                params,
            )
            rows = result.all()
            if rows:
                total = int(rows[0].total)
            else:  # an empty page: the total still counts (and an unknown head is an error)
                if query.head_sequence and not await has(conn, trace.id, query.head_sequence):
                    raise InvalidArgument(f"head_sequence {query.head_sequence} is not in the trace")
                count = select(func.count()).select_from(_M).where(*where)
                total = int(await conn.scalar(count, params) or 0)
            return MessagePage([message_from_row(r) for r in rows], head, total)

        return await self.db.run(work)


_M = MESSAGES
_MESSAGES = select(*MESSAGE_COLUMNS).select_from(MESSAGES_WITH_AGENT)
