"""Traces and messages in SQL: sequences allocated under the trace's row lock, branches, the main
path as a recursive CTE, cascade deletes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, bindparam, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from libs.errors import AlreadyExists, InvalidArgument
from libs.ids import check_local_id
from libs.protojson import enum_to_str
from services.trace import domain
from services.trace.store.base import Deleted, MessagePage, MessageQuery, TraceStore
from services.trace.store.sql.common import (
    KIND,
    MSG_STATUS,
    ROLE,
    SOURCE,
    Database,
    chunks,
    from_struct,
    message_pb,
    name_of,
    now,
    trace_pb,
)
from services.trace.store.sql.models import A2ATaskRow, MessageRow, SessionRow, SubagentRow


def _build_main_path() -> Select[tuple[int]]:
    """The sequences on the chain from `:head` back to the root of trace `:sid` (a recursive CTE).
    Built once with bind parameters: building the expression costs more than running it."""
    m = MessageRow.__table__
    path = (
        select(m.c.sequence, m.c.parent_sequence)
        .where(m.c.session_id == bindparam("sid"), m.c.sequence == bindparam("head"))
        .cte("path", recursive=True)
    )
    step = m.alias("step")
    path = path.union_all(
        select(step.c.sequence, step.c.parent_sequence).where(
            step.c.session_id == bindparam("sid"), step.c.sequence == path.c.parent_sequence
        )
    )
    return select(path.c.sequence)


MAIN_PATH = _build_main_path()
_PATH_COUNT = select(func.count()).select_from(MAIN_PATH.subquery())


class SqlTraceStore(TraceStore):
    def __init__(self, db: Database) -> None:
        self.db = db

    @staticmethod
    async def _has_sequence(db: AsyncSession, trace_id: str, sequence: int) -> bool:
        found = await db.scalar(
            select(MessageRow.id).where(MessageRow.session_id == trace_id, MessageRow.sequence == sequence)
        )
        return found is not None

    # ---- traces -----------------------------------------------------------------------------------

    async def create_trace(self, owner: str, trace: tp.Trace, trace_id: str = "") -> tp.Trace:
        domain.need_owner(owner)
        if trace_id:
            check_local_id(trace_id, "trace_id")
        kind = enum_to_str(KIND, trace.kind) or "chat"
        async with self.db.tx() as db:
            if trace_id and await db.get(SessionRow, trace_id) is not None:
                raise AlreadyExists("trace already exists")
            uid = await self.db.user_id(db, owner, create=True)
            stamp = now()
            row = SessionRow(
                id=trace_id or str(uuid.uuid4()),
                user_id=uid,
                agent=trace.agent,
                kind=kind,
                visible_in_sidebar=int(trace.visible_in_sidebar),
                title=trace.title,
                created_at=stamp,
                updated_at=stamp,
            )
            db.add(row)
            try:
                await db.flush()
            except IntegrityError as exc:  # a concurrent create with the same id
                raise AlreadyExists("trace already exists") from exc
        return trace_pb(row, owner)

    async def get_trace(self, owner: str, trace_id: str) -> tp.Trace:
        async with self.db.read() as db:
            return trace_pb(await self.db.trace_row(db, owner, trace_id), owner)

    async def count_messages(self, owner: str, trace_id: str) -> tuple[int, int]:
        async with self.db.read() as db:
            row = await self.db.trace_row(db, owner, trace_id)
            count = await db.scalar(
                select(func.count()).select_from(MessageRow).where(MessageRow.session_id == row.id)
            )
            path = 0
            if row.head_sequence:
                path = await db.scalar(_PATH_COUNT, {"sid": row.id, "head": row.head_sequence}) or 0
            return int(count or 0), int(path)

    async def list_traces(self, owner: str, page_size: int, page_token: str) -> tuple[list[tp.Trace], str]:
        """Chat traces, and hidden ones that are visible_in_sidebar."""
        domain.need_owner(owner)
        size = domain.page_size(page_size)
        stmt = select(SessionRow).where(
            self.db.owned(owner), or_(SessionRow.kind == "chat", SessionRow.visible_in_sidebar == 1)
        )
        if page_token:
            after_time, after_id = domain.decode_page_token(page_token)
            stmt = stmt.where(
                or_(
                    SessionRow.updated_at < after_time,
                    and_(SessionRow.updated_at == after_time, SessionRow.id < after_id),
                )
            )
        stmt = stmt.order_by(SessionRow.updated_at.desc(), SessionRow.id.desc()).limit(size + 1)
        async with self.db.read() as db:
            rows = list((await db.scalars(stmt)).all())
        last = rows[size - 1] if len(rows) > size else None
        token = domain.encode_page_token(last.updated_at, last.id) if last is not None else ""
        return [trace_pb(r, owner) for r in rows[:size]], token

    async def update_trace(self, owner: str, trace: tp.Trace, paths: Sequence[str]) -> tp.Trace:
        fields = domain.check_mask(paths, domain.TRACE_FIELDS)
        if "title" in fields and len(trace.title) > 500:
            raise InvalidArgument("title is at most 500 characters")
        async with self.db.tx() as db:
            row = await self.db.trace_row(db, owner, trace.id)
            if "title" in fields:
                row.title = trace.title
            if "visible_in_sidebar" in fields:
                row.visible_in_sidebar = int(trace.visible_in_sidebar)
            row.updated_at = now()
        return trace_pb(row, owner)

    async def delete_traces(self, owner: str, trace_ids: Sequence[str] | None) -> Deleted:
        domain.need_owner(owner)
        async with self.db.tx() as db:
            if trace_ids is None:
                roots = set((await db.scalars(select(SessionRow.id).where(self.db.owned(owner)))).all())
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
                            select(A2ATaskRow.session_id).where(A2ATaskRow.caller_session_id.in_(chunk))
                        )
                    ).all()
                )
                found.update(
                    s
                    for s in (
                        await db.scalars(
                            select(SubagentRow.child_session_id).where(SubagentRow.session_id.in_(chunk))
                        )
                    ).all()
                    if s
                )
            frontier = found - everything
            everything |= frontier
        out = Deleted(trace_ids=sorted(everything))
        for chunk in chunks(everything):
            sub_where = or_(SubagentRow.session_id.in_(chunk), SubagentRow.child_session_id.in_(chunk))
            task_where = or_(A2ATaskRow.session_id.in_(chunk), A2ATaskRow.caller_session_id.in_(chunk))
            out.subagent_ids += (await db.scalars(select(SubagentRow.public_id).where(sub_where))).all()
            out.task_ids += (await db.scalars(select(A2ATaskRow.id).where(task_where))).all()
            await db.execute(delete(SubagentRow).where(sub_where))
            await db.execute(delete(A2ATaskRow).where(task_where))
            await db.execute(delete(MessageRow).where(MessageRow.session_id.in_(chunk)))
        for chunk in chunks(everything):
            await db.execute(delete(SessionRow).where(SessionRow.id.in_(chunk)))
        out.subagent_ids = sorted(set(out.subagent_ids))
        out.task_ids = sorted(set(out.task_ids))
        return out

    async def set_head(self, owner: str, trace_id: str, head_sequence: int) -> tp.Trace:
        async with self.db.tx() as db:
            row = await self.db.trace_row(db, owner, trace_id, lock=True)
            if head_sequence <= 0 or not await self._has_sequence(db, row.id, head_sequence):
                raise InvalidArgument(f"head_sequence {head_sequence} is not in the trace")
            row.head_sequence = head_sequence
        return trace_pb(row, owner)

    # ---- messages ---------------------------------------------------------------------------------

    async def append_message(
        self, owner: str, message: tp.Message, parent_sequence: int | None = None
    ) -> tp.Message:
        role = name_of(ROLE, message.role, "message role")
        source = enum_to_str(SOURCE, message.source) or "user"
        status = enum_to_str(MSG_STATUS, message.status) or "completed"
        async with self.db.tx() as db:
            trace = await self.db.trace_row(db, owner, message.trace_id, lock=True)
            if parent_sequence is None:
                parent = trace.head_sequence or None
            elif parent_sequence == 0:
                parent = None
            elif await self._has_sequence(db, trace.id, parent_sequence):
                parent = parent_sequence
            else:
                raise InvalidArgument(f"parent_sequence {parent_sequence} is not in the trace")
            caller_agent = await self.db.agent_row(db, owner, message.caller_agent, required=False)
            stamp = now()
            trace.last_sequence += 1
            trace.head_sequence = trace.last_sequence
            trace.updated_at = stamp
            row = MessageRow(
                session_id=trace.id,
                sequence=trace.last_sequence,
                parent_sequence=parent,
                role=role,
                content=message.content,
                thinking=message.thinking,
                meta=from_struct(message, "metadata"),
                model=message.model,
                input_tokens=message.usage.input_tokens,
                output_tokens=message.usage.output_tokens,
                status=status,
                source=source,
                a2a_task_id=message.a2a_task_id or None,
                caller_agent=caller_agent,
                caller_session_id=message.caller_session_id or None,
                created_at=stamp,
            )
            db.add(row)
            await db.flush()
            return message_pb(row)

    async def update_message(self, owner: str, message: tp.Message, paths: Sequence[str]) -> tp.Message:
        fields = domain.check_mask(paths, domain.MESSAGE_FIELDS)
        async with self.db.tx() as db:
            row = await self.db.owned_row(db, MessageRow, MessageRow.id == message.id, owner, "message")
            if "content" in fields:
                row.content = message.content
            if "thinking" in fields:
                row.thinking = message.thinking
            if "metadata" in fields:
                row.meta = from_struct(message, "metadata")
            if "model" in fields:
                row.model = message.model
            if "usage" in fields:
                row.input_tokens = message.usage.input_tokens
                row.output_tokens = message.usage.output_tokens
            if "status" in fields:
                row.status = name_of(MSG_STATUS, message.status, "message status")
            await db.execute(
                update(SessionRow).where(SessionRow.id == row.session_id).values(updated_at=now())
            )
            return message_pb(row)

    async def get_message(self, owner: str, message_id: int) -> tp.Message:
        async with self.db.read() as db:
            return message_pb(
                await self.db.owned_row(db, MessageRow, MessageRow.id == message_id, owner, "message")
            )

    async def list_messages(self, owner: str, query: MessageQuery) -> MessagePage:
        limit = domain.check_window(query.limit, query.offset, query.since_sequence, query.head_sequence)
        if query.mode not in (ts.PATH_MODE_UNSPECIFIED, ts.PATH_MODE_MAIN_PATH, ts.PATH_MODE_ALL):
            raise InvalidArgument("unknown list mode")
        async with self.db.read() as db:
            trace = await self.db.trace_row(db, owner, query.trace_id)
            head = query.head_sequence or trace.head_sequence
            where: list[ColumnElement[bool]] = [
                MessageRow.session_id == trace.id,
                MessageRow.sequence > query.since_sequence,
            ]
            params: dict[str, Any] = {}
            if query.mode == ts.PATH_MODE_ALL:
                # Every branch is listed whatever the head, but an unknown head is an error in both
                # modes, on every page (main path mode finds out below, from an empty page).
                if query.head_sequence and not await self._has_sequence(db, trace.id, query.head_sequence):
                    raise InvalidArgument(f"head_sequence {query.head_sequence} is not in the trace")
            else:
                if not head:
                    return MessagePage([], 0, 0)
                where.append(MessageRow.sequence.in_(MAIN_PATH))
                params = {"sid": trace.id, "head": head}
            # One query: the page, and the total before limit/offset as a window count.
            total_col = func.count().over().label("total")
            result = await db.execute(
                select(MessageRow, total_col)
                .where(*where)
                .order_by(MessageRow.sequence)
                .offset(query.offset)
                .limit(limit),
                params,
            )
            rows = result.all()
            if rows:
                total = int(rows[0].total)
            else:  # an empty page: the total still counts (and an unknown head is an error)
                if query.head_sequence and not await self._has_sequence(db, trace.id, query.head_sequence):
                    raise InvalidArgument(f"head_sequence {query.head_sequence} is not in the trace")
                count = select(func.count()).select_from(MessageRow).where(*where)
                total = int(await db.scalar(count, params) or 0)
            return MessagePage([message_pb(r.MessageRow) for r in rows], head, total)
