"""Traces in SQL: rows of `traces` with their head, the main path as a recursive CTE, cascade
deletes."""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from datetime import datetime

from sqlalchemy import Select, and_, bindparam, delete, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from agentmesh.libs.errors import AlreadyExists, InvalidArgument
from agentmesh.libs.protojson import enum_to_str
from agentmesh.services.trace.domain import Cursor
from agentmesh.services.trace.store.base import Deleted, TraceStore
from agentmesh.services.trace.store.sql.common import KIND, Database, chunks, now, trace_pb
from agentmesh.services.trace.store.sql.models import A2ATaskRow, MessageRow, SubagentRow, TraceRow
from agentmesh.trace.v1 import trace_pb2 as tp


def _build_main_path() -> Select[tuple[int]]:
    """The sequences on the chain from `:head` back to the root of trace `:sid` (a recursive CTE).
    Built once with bind parameters: building the expression costs more than running it."""
    m = MessageRow.__table__
    path = (
        select(m.c.sequence, m.c.parent_sequence)
        .where(m.c.trace_id == bindparam("sid"), m.c.sequence == bindparam("head"))
        .cte("path", recursive=True)
    )
    step = m.alias("step")
    path = path.union_all(
        select(step.c.sequence, step.c.parent_sequence).where(
            step.c.trace_id == bindparam("sid"), step.c.sequence == path.c.parent_sequence
        )
    )
    return select(path.c.sequence)


MAIN_PATH = _build_main_path()
_PATH_COUNT = select(func.count()).select_from(MAIN_PATH.subquery())


def new_trace_row(owner_uid: int, trace: tp.Trace, trace_id: str, stamp: datetime) -> TraceRow:
    """The row of a new trace (an unset kind is a chat, as trace.proto says)."""
    return TraceRow(
        id=trace_id or str(uuid.uuid4()),
        user_id=owner_uid,
        agent=trace.agent,
        kind=enum_to_str(KIND, trace.kind) or "chat",
        visible_in_sidebar=int(trace.visible_in_sidebar),
        title=trace.title,
        created_at=stamp,
        updated_at=stamp,
    )


class SqlTraceStore(TraceStore):
    def __init__(self, db: Database) -> None:
        self.db = db

    @staticmethod
    async def _has_sequence(db: AsyncSession, trace_id: str, sequence: int) -> bool:
        found = await db.scalar(
            select(MessageRow.id).where(MessageRow.trace_id == trace_id, MessageRow.sequence == sequence)
        )
        return found is not None

    async def create_trace(self, owner: str, trace: tp.Trace, trace_id: str) -> tp.Trace:
        async with self.db.tx() as db:
            if trace_id and await db.get(TraceRow, trace_id) is not None:
                raise AlreadyExists("trace already exists")
            row = new_trace_row(await self.db.user_id(db, owner), trace, trace_id, now())
            db.add(row)
            try:
                await db.flush()
            except IntegrityError as exc:  # a concurrent create with the same id
                raise AlreadyExists("trace already exists") from exc
        return trace_pb(row, owner)

    async def get_trace(self, owner: str, trace_id: str) -> tp.Trace:
        async def read(conn: AsyncConnection) -> tp.Trace:
            return trace_pb(await self.db.owned_trace(conn, owner, trace_id), owner)

        return await self.db.run(read)

    async def count_messages(self, owner: str, trace_id: str) -> tuple[int, int]:
        async with self.db.read() as db:
            row = await self.db.trace_row(db, owner, trace_id)
            count = await db.scalar(
                select(func.count()).select_from(MessageRow).where(MessageRow.trace_id == row.id)
            )
            path = 0
            if row.head_sequence:
                path = await db.scalar(_PATH_COUNT, {"sid": row.id, "head": row.head_sequence}) or 0
            return int(count or 0), int(path)

    async def list_traces(self, owner: str, limit: int, after: Cursor | None) -> list[tp.Trace]:
        stmt = select(TraceRow).where(
            self.db.owned(owner),
            or_(TraceRow.kind == "chat", TraceRow.visible_in_sidebar == 1),
            TraceRow.home.is_(None),  # cached copies of peers' traces are never listed
        )
        if after is not None:
            stmt = stmt.where(
                or_(
                    TraceRow.updated_at < after.time,
                    and_(TraceRow.updated_at == after.time, TraceRow.id < after.id),
                )
            )
        stmt = stmt.order_by(TraceRow.updated_at.desc(), TraceRow.id.desc()).limit(limit)
        async with self.db.read() as db:
            return [trace_pb(r, owner) for r in (await db.scalars(stmt)).all()]

    async def update_trace(self, owner: str, trace: tp.Trace, fields: Collection[str]) -> tp.Trace:
        async with self.db.tx() as db:
            row = await self.db.trace_row(db, owner, trace.id)
            if "title" in fields:
                row.title = trace.title
            if "visible_in_sidebar" in fields:
                row.visible_in_sidebar = int(trace.visible_in_sidebar)
            row.updated_at = now()
        return trace_pb(row, owner)

    async def delete_traces(self, owner: str, trace_ids: Sequence[str] | None) -> Deleted:
        async with self.db.tx() as db:
            if trace_ids is None:
                roots = set((await db.scalars(select(TraceRow.id).where(self.db.owned(owner)))).all())
            else:
                roots = {(await self.db.trace_row(db, owner, tid)).id for tid in trace_ids}
            return await self._cascade(db, roots)

    async def _cascade(self, db: AsyncSession, roots: set[str]) -> Deleted:
        """Deletes `roots` plus the callee traces of their A2A tasks and their subagents' traces,
        recursively, with every dependent row, in the caller's transaction."""
        everything, frontier = set(roots), set(roots)
        while frontier:
            found: set[str] = set()
            for chunk in chunks(frontier):
                found.update(
                    (
                        await db.scalars(
                            select(A2ATaskRow.trace_id).where(A2ATaskRow.caller_trace_id.in_(chunk))
                        )
                    ).all()
                )
                found.update(
                    s
                    for s in (
                        await db.scalars(
                            select(SubagentRow.child_trace_id).where(SubagentRow.trace_id.in_(chunk))
                        )
                    ).all()
                    if s
                )
            frontier = found - everything
            everything |= frontier
        out = Deleted(trace_ids=sorted(everything))
        for chunk in chunks(everything):
            sub_where = or_(SubagentRow.trace_id.in_(chunk), SubagentRow.child_trace_id.in_(chunk))
            task_where = or_(A2ATaskRow.trace_id.in_(chunk), A2ATaskRow.caller_trace_id.in_(chunk))
            out.subagent_ids += (await db.scalars(select(SubagentRow.public_id).where(sub_where))).all()
            out.task_ids += (await db.scalars(select(A2ATaskRow.id).where(task_where))).all()
            await db.execute(delete(SubagentRow).where(sub_where))
            await db.execute(delete(A2ATaskRow).where(task_where))
            await db.execute(delete(MessageRow).where(MessageRow.trace_id.in_(chunk)))
        for chunk in chunks(everything):
            await db.execute(delete(TraceRow).where(TraceRow.id.in_(chunk)))
        out.subagent_ids = sorted(set(out.subagent_ids))
        out.task_ids = sorted(set(out.task_ids))
        return out

    async def set_head(self, owner: str, trace_id: str, head_sequence: int) -> tp.Trace:
        async with self.db.tx() as db:
            row = await self.db.trace_row(db, owner, trace_id, lock=True)
            if not await self._has_sequence(db, row.id, head_sequence):
                raise InvalidArgument(f"head_sequence {head_sequence} is not in the trace")
            row.head_sequence = head_sequence
        return trace_pb(row, owner)
