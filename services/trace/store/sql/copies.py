"""Cached copies of peers' traces in SQL: trace rows with a `home`, their messages stored under the
peer's sequences (so an incremental read is `since_sequence = home_sequence`)."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence

from google.protobuf import json_format
from sqlalchemy import bindparam, delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from agentmesh.libs.errors import FailedPrecondition
from agentmesh.libs.protojson import enum_to_str
from agentmesh.services.trace import domain
from agentmesh.services.trace.store.base import CopyState, CopyStore
from agentmesh.services.trace.store.sql.common import (
    KIND,
    ROLE,
    TRACES,
    USERS,
    Database,
    message_pb,
    name_of,
    now,
)
from agentmesh.services.trace.store.sql.models import MessageRow, TraceRow
from agentmesh.trace.v1 import trace_pb2 as tp

# Of traces `:ids`, the live copies, with their owner's name: one statement for every owner of a batch.
_HOMES = (
    select(TRACES.c.id, TRACES.c.home, USERS.c.name)
    .join(USERS, USERS.c.id == TRACES.c.user_id)
    .where(
        TRACES.c.id.in_(bindparam("ids", expanding=True)),
        TRACES.c.home.is_not(None),
        TRACES.c.deleted_at.is_(None),
    )
)


def _state(row: TraceRow, outbox: int = 0, pending_from: int = 0, outbox_pending: int = 0) -> CopyState:
    return CopyState(
        trace_id=row.id,
        home=row.home or "",
        home_sequence=row.home_sequence,
        synced_at=domain.aware(row.synced_at) if row.synced_at else None,
        outbox=outbox,
        pending_from=pending_from,
        outbox_pending=outbox_pending,
    )


class SqlCopyStore(CopyStore):
    def __init__(self, db: Database) -> None:
        self.db = db

    async def _extras(self, db: AsyncSession, row: TraceRow) -> CopyState:
        outbox = await db.scalar(
            select(func.count())
            .select_from(MessageRow)
            .where(MessageRow.trace_id == row.id, MessageRow.sequence > row.home_sequence)
        )
        pending = await db.scalar(
            select(func.min(MessageRow.sequence)).where(
                MessageRow.trace_id == row.id,
                MessageRow.status == "pending",
                MessageRow.sequence <= row.home_sequence,
            )
        )
        outbox_pending: int | None = 0
        if outbox:
            outbox_pending = await db.scalar(
                select(func.count())
                .select_from(MessageRow)
                .where(
                    MessageRow.trace_id == row.id,
                    MessageRow.sequence > row.home_sequence,
                    MessageRow.status == "pending",
                )
            )
        return _state(row, int(outbox or 0), int(pending or 0), int(outbox_pending or 0))

    async def find(self, owner: str, home: str) -> CopyState | None:
        async with self.db.read() as db:
            row = await db.scalar(select(TraceRow).where(TraceRow.home == home, self.db.owned(owner)))
            return None if row is None else await self._extras(db, row)

    async def of_trace(self, owner: str, trace_id: str) -> CopyState | None:
        if not await self.homes({(owner, trace_id)}):  # most traces are not copies: one light read says so
            return None
        async with self.db.read() as db:
            row = await db.scalar(
                select(TraceRow).where(
                    TraceRow.id == trace_id, TraceRow.home.is_not(None), self.db.owned(owner)
                )
            )
            return None if row is None else await self._extras(db, row)

    async def homes(self, owned: Collection[tuple[str, str]]) -> dict[tuple[str, str], str]:
        wanted = set(owned)
        if not wanted:
            return {}

        async def read(conn: AsyncConnection) -> dict[tuple[str, str], str]:
            rows = await conn.execute(_HOMES, {"ids": sorted({trace_id for _, trace_id in wanted})})
            return {(r.name, r.id): r.home for r in rows if (r.name, r.id) in wanted}

        return await self.db.run(read)

    async def save(
        self, owner: str, home: str, trace: tp.Trace, messages: Sequence[tp.Message], final: bool
    ) -> CopyState:
        try:
            return await self._save(owner, home, trace, messages, final)
        except IntegrityError:  # two first reads of one trace at once: the other created the copy
            return await self._save(owner, home, trace, messages, final)

    async def _save(
        self, owner: str, home: str, trace: tp.Trace, messages: Sequence[tp.Message], final: bool
    ) -> CopyState:
        stamp = now()
        async with self.db.tx() as db:
            row = await db.scalar(
                select(TraceRow).where(TraceRow.home == home, self.db.owned(owner)).with_for_update()
            )
            if row is None:
                uid = await self.db.user_id(db, owner)
                row = TraceRow(
                    id=str(uuid.uuid4()),
                    user_id=uid,
                    kind="chat",
                    visible_in_sidebar=0,
                    home=home,
                    home_sequence=0,
                    created_at=stamp,
                    updated_at=stamp,
                )
                db.add(row)
                await db.flush()
            if row.home_sequence < row.last_sequence:
                raise FailedPrecondition(f"a turn is running on {home} here; try again when it ends")
            row.agent = trace.agent
            row.kind = enum_to_str(KIND, trace.kind) or "chat"
            row.title = trace.title[:500]
            if messages:
                sequences = [m.sequence for m in messages]
                existing = {
                    r.sequence: r
                    for r in (
                        await db.scalars(
                            select(MessageRow).where(
                                MessageRow.trace_id == row.id, MessageRow.sequence.in_(sequences)
                            )
                        )
                    ).all()
                }
                for m in messages:
                    target = existing.get(m.sequence)
                    if target is None:
                        target = MessageRow(trace_id=row.id, sequence=m.sequence)
                        db.add(target)
                    target.parent_sequence = m.parent_sequence or None
                    target.role = name_of(ROLE, m.role or tp.MESSAGE_ROLE_USER, "message role")
                    target.content = m.content
                    target.thinking = m.thinking
                    target.meta = json_format.MessageToDict(m.metadata) if m.HasField("metadata") else None
                    target.model = m.model
                    target.input_tokens = m.usage.input_tokens
                    target.output_tokens = m.usage.output_tokens
                    target.status = enum_to_str(tp.MessageStatus.DESCRIPTOR, m.status) or "completed"
                    target.source = enum_to_str(tp.MessageSource.DESCRIPTOR, m.source) or "user"
                    target.a2a_task_id = m.a2a_task_id[:64] or None
                    target.caller_trace_id = m.caller_trace_id[:200] or None
                    target.home_id = m.id or None
                    target.home_caller_agent = m.caller_agent[:100] or None
                    target.created_at = (
                        m.create_time.ToDatetime(tzinfo=stamp.tzinfo) if m.HasField("create_time") else stamp
                    )
                top = max(sequences)
                row.home_sequence = max(row.home_sequence, top)
                row.last_sequence = max(row.last_sequence, top)
            row.head_sequence = trace.head_sequence
            if final:
                row.synced_at = stamp
            row.updated_at = stamp
            await db.flush()
            return _state(row)

    async def outbox(self, owner: str, trace_id: str) -> list[tp.Message]:
        async with self.db.read() as db:
            row = await self.db.trace_row(db, owner, trace_id)
            rows = (
                await db.scalars(
                    select(MessageRow)
                    .where(MessageRow.trace_id == row.id, MessageRow.sequence > row.home_sequence)
                    .order_by(MessageRow.sequence)
                )
            ).all()
            return [message_pb(r) for r in rows]

    async def drop_outbox(self, owner: str, trace_id: str) -> None:
        async with self.db.tx() as db:
            row = await self.db.trace_row(db, owner, trace_id, lock=True)
            first = await db.scalar(
                select(MessageRow.parent_sequence)
                .where(MessageRow.trace_id == row.id, MessageRow.sequence > row.home_sequence)
                .order_by(MessageRow.sequence)
                .limit(1)
            )
            await db.execute(
                delete(MessageRow).where(
                    MessageRow.trace_id == row.id, MessageRow.sequence > row.home_sequence
                )
            )
            row.last_sequence = row.home_sequence
            if row.head_sequence > row.home_sequence:
                row.head_sequence = first or 0
