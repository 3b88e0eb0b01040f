"""Traces and messages in SQL: sequences allocated under the trace's row lock, branches, the main
path as a recursive CTE, cascade deletes."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, bindparam, delete, func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from agentmesh.libs.errors import AlreadyExists, InvalidArgument, MeshError, NotFound
from agentmesh.libs.ids import check_local_id
from agentmesh.libs.protojson import enum_to_str
from agentmesh.services.trace import domain
from agentmesh.services.trace.store.base import (
    Append,
    Deleted,
    MessagePage,
    MessageQuery,
    TraceStore,
    each_apart,
)
from agentmesh.services.trace.store.sql.appends import (
    AppendBatcher,
    Item,
    make_item,
    pg_write,
    sqlite_write,
    write_first,
)
from agentmesh.services.trace.store.sql.common import (
    AGENTS,
    KIND,
    MESSAGE_COLUMNS,
    MESSAGES,
    MESSAGES_WITH_AGENT,
    MSG_STATUS,
    SESSIONS,
    Database,
    chunks,
    from_struct,
    message_columns,
    message_from_row,
    name_of,
    now,
    trace_pb,
)
from agentmesh.services.trace.store.sql.models import A2ATaskRow, MessageRow, SessionRow, SubagentRow
from agentmesh.services.trace.store.sql.updates import Update, UpdateBatcher
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts


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
        self.appends = AppendBatcher(db)
        self.updates = UpdateBatcher(db)

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
            uid = await self.db.user_id(db, owner)
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
            self.db.owned(owner),
            or_(SessionRow.kind == "chat", SessionRow.visible_in_sidebar == 1),
            SessionRow.home.is_(None),  # cached copies of peers' traces are never listed
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
        if not messages:
            raise InvalidArgument("no messages to append")
        for m in messages:
            if m.trace_id and m.trace_id != trace_id:
                raise InvalidArgument("every message must belong to the trace")
        return [
            make_item(owner, m, parent_sequence if i == 0 else None, trace_id) for i, m in enumerate(messages)
        ]

    async def create_trace_with_messages(
        self, owner: str, trace: tp.Trace, trace_id: str, messages: Sequence[tp.Message]
    ) -> tuple[tp.Trace, list[tp.Message]]:
        """A new trace and its first messages, in one transaction (nothing when any is refused)."""
        if trace_id:
            check_local_id(trace_id, "trace_id")
        tid = trace_id or str(uuid.uuid4())
        items = self._items(owner, tid, messages, None)
        kind = enum_to_str(KIND, trace.kind) or "chat"
        # Core statements in one transaction (a turn's set-up waits for it: no ORM unit of work). The
        # trace is new: its row is inserted with its counter and head at the last message, and the
        # messages in one INSERT, unless one names a caller agent (looked up by the general write).
        first = not any(it.message.caller_agent for it in items)
        write = write_first if first else sqlite_write if self.db.sqlite else pg_write
        async with self.db.write_lock, self.db.engine.begin() as conn:
            stamp = now()
            row = SessionRow(
                id=tid,
                user_id=await self.db.user_id(conn, owner),
                agent=trace.agent,
                kind=kind,
                visible_in_sidebar=int(trace.visible_in_sidebar),
                title=trace.title,
                created_at=stamp,
                updated_at=stamp,
                last_sequence=len(items) if first else 0,
                head_sequence=len(items) if first else 0,
            )
            values = {c.key: getattr(row, c.key) for c in SESSIONS.columns if getattr(row, c.key) is not None}
            try:
                await conn.execute(SESSIONS.insert(), values)  # not .values(): a cache key per call
            except IntegrityError as exc:
                raise AlreadyExists("trace already exists") from exc
            written = await write(conn, items, stamp)
        # A new trace of the caller's, default parents: every message is written.
        stored = [written[i] for i in range(len(items))]
        out = trace_pb(row, owner)
        out.head_sequence = stored[-1].sequence
        return out, stored

    async def update_message(self, owner: str, message: tp.Message, paths: Sequence[str]) -> tp.Message:
        fields = domain.check_mask(paths, domain.MESSAGE_FIELDS)
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
        domain.need_owner(owner)
        if self.db.sqlite:  # concurrent updates in one transaction (its single writer)
            return await self.updates.update(Update(owner, message.id, values))
        owned = select(_S.c.id).where(self.db.owned(owner))
        changed = update(_M).where(_M.c.id == message.id, _M.c.session_id.in_(owned)).values(**values)
        stamp = now()

        async def pg(conn: AsyncConnection) -> Any:
            # One statement: the message, its trace's updated_at, and the row read back.
            m = changed.returning(*_M.c).cte("changed")
            touched = update(_S).where(_S.c.id.in_(select(m.c.session_id))).values(updated_at=stamp)
            stmt = (
                select(*message_columns(m))
                .select_from(m.outerjoin(_A, _A.c.id == m.c.caller_agent_id))
                .add_cte(touched.cte("touched"))
            )
            return (await conn.execute(stmt)).first()

        row = await self.db.run(pg, write=True)
        if row is None:
            raise NotFound("message not found")
        return message_from_row(row)

    async def get_message(self, owner: str, message_id: int) -> tp.Message:
        domain.need_owner(owner)
        owned = select(_S.c.id).where(self.db.owned(owner))
        stmt = _MESSAGES.where(_M.c.id == message_id, _M.c.session_id.in_(owned))

        async def work(conn: AsyncConnection) -> Any:
            return (await conn.execute(stmt)).first()

        row = await self.db.run(work)
        if row is None:
            raise NotFound("message not found")
        return message_from_row(row)

    async def list_messages(self, owner: str, query: MessageQuery) -> MessagePage:
        limit = domain.check_window(query.limit, query.offset, query.since_sequence, query.head_sequence)
        if query.mode not in (ts.PATH_MODE_UNSPECIFIED, ts.PATH_MODE_MAIN_PATH, ts.PATH_MODE_ALL):
            raise InvalidArgument("unknown list mode")

        async def has(conn: AsyncConnection, trace_id: str, sequence: int) -> bool:
            found = await conn.scalar(
                select(_M.c.id).where(_M.c.session_id == trace_id, _M.c.sequence == sequence)
            )
            return found is not None

        async def work(conn: AsyncConnection) -> MessagePage:
            trace = await self.db.owned_trace(conn, owner, query.trace_id)
            head = query.head_sequence or trace.head_sequence
            where: list[ColumnElement[bool]] = [
                _M.c.session_id == trace.id,
                _M.c.sequence > query.since_sequence,
            ]
            params: dict[str, Any] = {}
            if query.mode == ts.PATH_MODE_ALL:
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
                .limit(limit),
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


_M, _S, _A = MESSAGES, SESSIONS, AGENTS
_MESSAGES = select(*MESSAGE_COLUMNS).select_from(MESSAGES_WITH_AGENT)
