"""TraceStore: the trace domain over SQLAlchemy (one async method per TraceService RPC).

Every method that takes an id also takes the acting owner; another owner's row is answered exactly
like a missing one (NotFound with the same message), so ids cannot be probed.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf import json_format, struct_pb2, timestamp_pb2
from sqlalchemy import ColumnElement, Select, and_, bindparam, delete, func, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from agentmesh.v1 import events_pb2, trace_pb2
from libs.catalog import Catalog
from libs.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unauthenticated
from libs.protojson import enum_to_str, str_to_enum
from services.trace.db import session_factory
from services.trace.models import A2ATaskRow, Agent, ApiKey, MessageRow, SessionRow, SubagentRow, User

DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 50, 200
DEFAULT_LIMIT, MAX_LIMIT = 100, 1000
_CHUNK = 500  # ids per IN (...) clause
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

_KIND = trace_pb2.SessionKind.DESCRIPTOR
_ROLE = trace_pb2.MessageRole.DESCRIPTOR
_SOURCE = trace_pb2.MessageSource.DESCRIPTOR
_MSG_STATUS = trace_pb2.MessageStatus.DESCRIPTOR
_TASK_STATE = trace_pb2.TaskState.DESCRIPTOR
_SUB_STATUS = events_pb2.SubagentStatus.DESCRIPTOR

TERMINAL_TASK_STATES = frozenset({"completed", "canceled", "failed", "rejected"})
# Allowed subagent status changes (seed 3): queued -> running -> completed | failed | cancelled.
SUBAGENT_TRANSITIONS = {
    "queued": frozenset({"running", "failed", "cancelled"}),
    "running": frozenset({"completed", "failed", "cancelled"}),
    "completed": frozenset(),
    "failed": frozenset(),
    "cancelled": frozenset(),
}
SESSION_FIELDS = frozenset({"title", "visible_in_sidebar"})
MESSAGE_FIELDS = frozenset({"content", "thinking", "metadata", "model", "usage", "status"})
SUBAGENT_FIELDS = frozenset(
    {
        "status",
        "model",
        "tool_names",
        "summary",
        "result_payload",
        "error",
        "token_usage",
        "start_time",
        "end_time",
    }
)


def _now() -> datetime:
    return datetime.now(UTC)


def _aware(dt: datetime) -> datetime:
    """SQLite hands timestamps back naive; they are stored in UTC."""
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def _ts(dt: datetime | None) -> timestamp_pb2.Timestamp | None:
    if dt is None:
        return None
    out = timestamp_pb2.Timestamp()
    out.FromDatetime(_aware(dt))
    return out


def _struct(data: dict[str, Any] | None) -> struct_pb2.Struct | None:
    if data is None:
        return None
    out = struct_pb2.Struct()
    out.update(data)
    return out


def _dict(msg: struct_pb2.Struct) -> dict[str, Any]:
    return json_format.MessageToDict(msg)


def _number(enum: Any, name: str) -> Any:
    """A stored enum name back to its proto number."""
    return str_to_enum(enum, name)


def _name(enum: Any, number: int, what: str) -> str:
    name = enum_to_str(enum, number)
    if not name:
        raise InvalidArgument(f"{what} is required")
    return name


def _need_owner(owner: str) -> None:
    if not owner:
        raise InvalidArgument("owner is required")


def _hash_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def _chunks(ids: Iterable[Any]) -> Iterable[list[Any]]:
    items = list(ids)
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def _encode_token(updated_at: datetime, session_id: str) -> str:
    raw = json.dumps([_aware(updated_at).isoformat(), session_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_token(token: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        stamp, session_id = json.loads(raw)
        return _aware(datetime.fromisoformat(stamp)), str(session_id)
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise InvalidArgument("invalid page_token") from exc


def _session_pb(row: SessionRow, owner: str) -> trace_pb2.Session:
    return trace_pb2.Session(
        id=row.id,
        owner=owner,
        agent=row.agent,
        kind=_number(_KIND, row.kind),
        visible_in_sidebar=bool(row.visible_in_sidebar),
        head_sequence=row.head_sequence,
        title=row.title,
        create_time=_ts(row.created_at),
        update_time=_ts(row.updated_at),
    )


def _message_pb(row: MessageRow) -> trace_pb2.Message:
    return trace_pb2.Message(
        id=row.id,
        session_id=row.session_id,
        sequence=row.sequence,
        parent_sequence=row.parent_sequence or 0,
        role=_number(_ROLE, row.role),
        content=row.content,
        thinking=row.thinking,
        metadata=_struct(row.meta),
        model=row.model,
        usage=events_pb2.Usage(input_tokens=row.input_tokens, output_tokens=row.output_tokens),
        sort_order=row.sort_order,
        source=_number(_SOURCE, row.source),
        a2a_task_id=row.a2a_task_id or "",
        caller_agent=row.caller_agent.slug if row.caller_agent else "",
        caller_session_id=row.caller_session_id or "",
        status=_number(_MSG_STATUS, row.status),
        create_time=_ts(row.created_at),
    )


def _task_pb(row: A2ATaskRow, owner: str) -> trace_pb2.A2ATask:
    return trace_pb2.A2ATask(
        id=row.id,
        session_id=row.session_id,
        callee_agent=row.session.agent,
        caller_agent=row.caller_agent.slug if row.caller_agent else "",
        caller_session_id=row.caller_session_id or "",
        caller_context=_struct(row.caller_context),
        state=_number(_TASK_STATE, row.state),
        visible_in_sidebar=bool(row.visible_in_sidebar),
        owner=owner,
        create_time=_ts(row.created_at),
        update_time=_ts(row.updated_at),
    )


def _usage_pb(data: dict[str, Any] | None) -> events_pb2.Usage | None:
    if data is None:
        return None
    return events_pb2.Usage(
        input_tokens=int(data.get("input_tokens", 0)), output_tokens=int(data.get("output_tokens", 0))
    )


def _usage_dict(usage: events_pb2.Usage) -> dict[str, int]:
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}


def _subagent_pb(row: SubagentRow) -> trace_pb2.SubagentSession:
    return trace_pb2.SubagentSession(
        id=row.id,
        session_id=row.session_id,
        parent_message_id=row.parent_message_id,
        parent_tool_call_id=row.parent_tool_call_id or "",
        parent_agent=row.parent_agent.slug if row.parent_agent else "",
        source_type=row.source_type,
        preset_agent=row.preset_agent.slug if row.preset_agent else "",
        name=row.name,
        goal=row.goal,
        context=row.context or "",
        status=_number(_SUB_STATUS, row.status),
        model=row.model,
        tool_names=row.tool_names or [],
        summary=row.summary or "",
        result_payload=_struct(row.result_payload),
        error=row.error or "",
        token_usage=_usage_pb(row.token_usage),
        sort_order=row.sort_order,
        start_time=_ts(row.started_at),
        end_time=_ts(row.ended_at),
        create_time=_ts(row.created_at),
        update_time=_ts(row.updated_at),
        child_session_id=row.child_session_id or "",
        batch_title=row.batch_title,
    )


def _build_main_path() -> Select[tuple[int]]:
    """The sequences on the chain from `:head` back to the root of session `:sid` (a recursive CTE).
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


def _mask(paths: Sequence[str], allowed: set[str] | frozenset[str]) -> set[str]:
    """The update_mask paths, checked against the fields an update may change."""
    fields = set(paths)
    if not fields:
        raise InvalidArgument("update_mask is required")
    if unknown := fields - allowed:
        raise InvalidArgument(f"cannot update {', '.join(sorted(unknown))}")
    return fields


R = TypeVar("R", MessageRow, SubagentRow)


class TraceStore:
    """The trace database. SQLite writes are serialised by a per-process lock; PostgreSQL relies on
    row locks (`SELECT ... FOR UPDATE` on the session row when allocating sequences)."""

    def __init__(self, engine: AsyncEngine, sessionmaker: async_sessionmaker[AsyncSession] | None = None):
        self.engine = engine
        self._sm = sessionmaker or session_factory(engine)
        self._sqlite = engine.dialect.name == "sqlite"
        self._write_lock = asyncio.Lock()

    # ---- plumbing ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _tx(self) -> AsyncIterator[AsyncSession]:
        """One write unit of work."""
        lock = self._write_lock if self._sqlite else contextlib.nullcontext()
        async with lock, self._sm.begin() as db:
            yield db

    @contextlib.asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncSession]:
        async with self._sm() as db:
            yield db

    def _insert(self, table: Any) -> Any:
        return (postgresql.insert if not self._sqlite else sqlite.insert)(table)

    async def _user_id(self, db: AsyncSession, name: str, *, create: bool) -> int | None:
        uid = await db.scalar(select(User.id).where(User.name == name))
        if uid is None and create:
            stmt = self._insert(User).values(name=name, created_at=_now())
            await db.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
            uid = await db.scalar(select(User.id).where(User.name == name))
        return uid

    async def _agent(self, db: AsyncSession, slug: str) -> Agent | None:
        if not slug:
            return None
        agent = await db.scalar(select(Agent).where(Agent.slug == slug))
        if agent is None:
            raise InvalidArgument(f"unknown agent {slug!r}")
        return agent

    @staticmethod
    def _owned(owner: str) -> ColumnElement[bool]:
        return and_(
            SessionRow.user_id == select(User.id).where(User.name == owner).scalar_subquery(),
            SessionRow.deleted_at.is_(None),
        )

    async def _session(
        self, db: AsyncSession, owner: str, session_id: str, *, lock: bool = False
    ) -> SessionRow:
        _need_owner(owner)
        if not session_id:
            raise InvalidArgument("session_id is required")
        stmt = select(SessionRow).where(SessionRow.id == session_id, self._owned(owner))
        if lock:
            stmt = stmt.with_for_update()
        row = await db.scalar(stmt)
        if row is None:
            raise NotFound("session not found")
        return row

    async def _owned_row(
        self, db: AsyncSession, model: type[R], row_id: int, owner: str, what: str, *, lock: bool = False
    ) -> R:
        """A row of a session `owner` owns (NotFound, like a missing one, for anyone else's)."""
        stmt = (
            select(model)
            .join(SessionRow, SessionRow.id == model.session_id)  # type: ignore[attr-defined]
            .where(model.id == row_id, self._owned(owner))  # type: ignore[attr-defined]
        )
        if lock:
            stmt = stmt.with_for_update(of=model)
        row = await db.scalar(stmt)
        if row is None:
            raise NotFound(f"{what} not found")
        return row

    @staticmethod
    async def _has_sequence(db: AsyncSession, session_id: str, sequence: int) -> bool:
        found = await db.scalar(
            select(MessageRow.id).where(MessageRow.session_id == session_id, MessageRow.sequence == sequence)
        )
        return found is not None

    async def _path_count(self, db: AsyncSession, row: SessionRow) -> int:
        if not row.head_sequence:
            return 0
        return int(await db.scalar(_PATH_COUNT, {"sid": row.id, "head": row.head_sequence}) or 0)

    # ---- agents -----------------------------------------------------------------------------------

    async def sync_agents(self, catalog: Catalog) -> None:
        """Upserts every catalog agent by slug (agents no longer listed are kept: rows reference them)."""
        async with self._tx() as db:
            for agent in catalog.agents:
                values = {
                    "slug": agent.slug,
                    "name": agent.name,
                    "description": agent.description,
                    "model": agent.model,
                    "config": agent.model_dump(mode="json", by_alias=True),
                }
                stmt = self._insert(Agent).values(**values)
                await db.execute(
                    stmt.on_conflict_do_update(
                        index_elements=["slug"],
                        set_={k: v for k, v in values.items() if k != "slug"},
                    )
                )

    # ---- sessions ---------------------------------------------------------------------------------

    async def create_session(
        self,
        owner: str,
        agent: str,
        kind: int = trace_pb2.SESSION_KIND_CHAT,
        title: str = "",
        visible_in_sidebar: bool = False,
        session_id: str = "",
    ) -> trace_pb2.Session:
        """Creates a session (default kind chat); the owner user is created when missing."""
        _need_owner(owner)
        kind_name = enum_to_str(_KIND, kind) or "chat"
        if session_id and not _SESSION_ID.match(session_id):
            raise InvalidArgument("session_id must be 1-64 characters of [A-Za-z0-9_.:-]")
        async with self._tx() as db:
            if session_id and await db.get(SessionRow, session_id) is not None:
                raise AlreadyExists("session already exists")
            uid = await self._user_id(db, owner, create=True)
            now = _now()
            row = SessionRow(
                id=session_id or str(uuid.uuid4()),
                user_id=uid,
                agent=agent,
                kind=kind_name,
                visible_in_sidebar=int(visible_in_sidebar),
                title=title,
                created_at=now,
                updated_at=now,
            )
            db.add(row)
            try:
                await db.flush()
            except IntegrityError as exc:  # a concurrent create with the same id
                raise AlreadyExists("session already exists") from exc
        return _session_pb(row, owner)

    async def get_session(self, owner: str, session_id: str) -> trace_pb2.Session:
        async with self._read() as db:
            return _session_pb(await self._session(db, owner, session_id), owner)

    async def list_sessions(
        self, owner: str, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[trace_pb2.Session], str]:
        """The owner's sessions, newest first; a2a and subagent sessions only when visible_in_sidebar."""
        _need_owner(owner)
        if page_size < 0:
            raise InvalidArgument("page_size must not be negative")
        size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        stmt = select(SessionRow).where(
            self._owned(owner), or_(SessionRow.kind == "chat", SessionRow.visible_in_sidebar == 1)
        )
        if page_token:
            after_time, after_id = _decode_token(page_token)
            stmt = stmt.where(
                or_(
                    SessionRow.updated_at < after_time,
                    and_(SessionRow.updated_at == after_time, SessionRow.id < after_id),
                )
            )
        stmt = stmt.order_by(SessionRow.updated_at.desc(), SessionRow.id.desc()).limit(size + 1)
        async with self._read() as db:
            rows = list((await db.scalars(stmt)).all())
        token = _encode_token(rows[size - 1].updated_at, rows[size - 1].id) if len(rows) > size else ""
        return [_session_pb(r, owner) for r in rows[:size]], token

    async def update_session(
        self, owner: str, session_id: str, title: str, visible_in_sidebar: bool, paths: Sequence[str]
    ) -> trace_pb2.Session:
        """Changes title and/or visible_in_sidebar (an empty mask means title)."""
        fields = set(paths) or {"title"}
        if unknown := fields - SESSION_FIELDS:
            raise InvalidArgument(f"cannot update {', '.join(sorted(unknown))}")
        async with self._tx() as db:
            row = await self._session(db, owner, session_id)
            if "title" in fields:
                row.title = title
            if "visible_in_sidebar" in fields:
                row.visible_in_sidebar = int(visible_in_sidebar)
            row.updated_at = _now()
        return _session_pb(row, owner)

    async def delete_session(self, owner: str, session_id: str) -> None:
        """Deletes the session and everything under it (messages, A2A tasks, subagents, hidden sessions)."""
        async with self._tx() as db:
            await self._session(db, owner, session_id)
            await self._cascade(db, {session_id})

    async def delete_sessions(self, owner: str) -> int:
        """Deletes every session of the owner; returns how many sessions of every kind were removed."""
        _need_owner(owner)
        async with self._tx() as db:
            ids = set((await db.scalars(select(SessionRow.id).where(self._owned(owner)))).all())
            return await self._cascade(db, ids)

    async def _cascade(self, db: AsyncSession, roots: set[str]) -> int:
        """Deletes `roots` plus the callee sessions of their A2A tasks and their subagents' sessions,
        recursively, with every dependent row, in the caller's transaction."""
        everything, frontier = set(roots), set(roots)
        while frontier:
            found: set[str] = set()
            for chunk in _chunks(frontier):
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
        for chunk in _chunks(everything):
            await db.execute(
                delete(SubagentRow).where(
                    or_(SubagentRow.session_id.in_(chunk), SubagentRow.child_session_id.in_(chunk))
                )
            )
            await db.execute(
                delete(A2ATaskRow).where(
                    or_(A2ATaskRow.session_id.in_(chunk), A2ATaskRow.caller_session_id.in_(chunk))
                )
            )
            await db.execute(delete(MessageRow).where(MessageRow.session_id.in_(chunk)))
        for chunk in _chunks(everything):
            await db.execute(delete(SessionRow).where(SessionRow.id.in_(chunk)))
        return len(everything)

    # ---- messages ---------------------------------------------------------------------------------

    async def append_message(
        self, owner: str, message: trace_pb2.Message, parent_sequence: int | None = None
    ) -> trace_pb2.Message:
        """Stores the next message of the session (sequence = last + 1) and moves the head to it.

        The parent is `parent_sequence` when given (0: a new root), else the current head."""
        role = _name(_ROLE, message.role, "message role")
        source = enum_to_str(_SOURCE, message.source) or "user"
        status = enum_to_str(_MSG_STATUS, message.status) or "completed"
        async with self._tx() as db:
            session = await self._session(db, owner, message.session_id, lock=True)
            if parent_sequence is None:
                parent = session.head_sequence or None
            elif parent_sequence == 0:
                parent = None
            elif await self._has_sequence(db, session.id, parent_sequence):
                parent = parent_sequence
            else:
                raise InvalidArgument(f"parent_sequence {parent_sequence} is not in the session")
            caller_agent = await self._agent(db, message.caller_agent)
            now = _now()
            session.last_sequence += 1
            session.head_sequence = session.last_sequence
            session.updated_at = now
            row = MessageRow(
                session_id=session.id,
                sequence=session.last_sequence,
                parent_sequence=parent,
                role=role,
                content=message.content,
                thinking=message.thinking,
                meta=_dict(message.metadata) if message.HasField("metadata") else None,
                model=message.model,
                input_tokens=message.usage.input_tokens,
                output_tokens=message.usage.output_tokens,
                sort_order=message.sort_order,
                status=status,
                source=source,
                a2a_task_id=message.a2a_task_id or None,
                caller_agent=caller_agent,
                caller_session_id=message.caller_session_id or None,
                created_at=now,
            )
            db.add(row)
            await db.flush()
            return _message_pb(row)

    async def update_message(
        self, owner: str, message: trace_pb2.Message, paths: Sequence[str]
    ) -> trace_pb2.Message:
        """Changes the fields named in `paths` (content, thinking, metadata, model, usage, status)."""
        _need_owner(owner)
        fields = _mask(paths, MESSAGE_FIELDS)
        async with self._tx() as db:
            row = await self._owned_row(db, MessageRow, message.id, owner, "message")
            if "content" in fields:
                row.content = message.content
            if "thinking" in fields:
                row.thinking = message.thinking
            if "metadata" in fields:
                row.meta = _dict(message.metadata) if message.HasField("metadata") else None
            if "model" in fields:
                row.model = message.model
            if "usage" in fields:
                row.input_tokens = message.usage.input_tokens
                row.output_tokens = message.usage.output_tokens
            if "status" in fields:
                row.status = _name(_MSG_STATUS, message.status, "message status")
            await db.execute(
                update(SessionRow).where(SessionRow.id == row.session_id).values(updated_at=_now())
            )
            return _message_pb(row)

    async def list_messages(
        self,
        owner: str,
        session_id: str,
        mode: int = trace_pb2.LIST_MODE_MAIN_PATH,
        head_sequence: int = 0,
        since_sequence: int = 0,
        limit: int = 0,
        offset: int = 0,
    ) -> tuple[list[trace_pb2.Message], int, int]:
        """(messages by sequence, the head used, total before limit/offset)."""
        if limit < 0 or limit > MAX_LIMIT:
            raise InvalidArgument(f"limit must be between 0 and {MAX_LIMIT}")
        if offset < 0:
            raise InvalidArgument("offset must not be negative")
        if since_sequence < 0 or head_sequence < 0:
            raise InvalidArgument("sequences must not be negative")
        if mode not in (
            trace_pb2.LIST_MODE_UNSPECIFIED,
            trace_pb2.LIST_MODE_MAIN_PATH,
            trace_pb2.LIST_MODE_ALL,
        ):
            raise InvalidArgument("unknown list mode")
        async with self._read() as db:
            session = await self._session(db, owner, session_id)
            head = head_sequence or session.head_sequence
            where: list[ColumnElement[bool]] = [
                MessageRow.session_id == session.id,
                MessageRow.sequence > since_sequence,
            ]
            params: dict[str, Any] = {}
            if mode != trace_pb2.LIST_MODE_ALL:
                if not head:
                    return [], 0, 0
                where.append(MessageRow.sequence.in_(MAIN_PATH))
                params = {"sid": session.id, "head": head}
            # One query: the page, and the total before limit/offset as a window count.
            total_col = func.count().over().label("total")
            result = await db.execute(
                select(MessageRow, total_col)
                .where(*where)
                .order_by(MessageRow.sequence)
                .offset(offset)
                .limit(limit or DEFAULT_LIMIT),
                params,
            )
            rows = result.all()
            if rows:
                total = int(rows[0].total)
            else:  # an empty page: the total still counts (and an unknown head is an error)
                if head_sequence and not await self._has_sequence(db, session.id, head_sequence):
                    raise InvalidArgument(f"head_sequence {head_sequence} is not in the session")
                count = select(func.count()).select_from(MessageRow).where(*where)
                total = int(await db.scalar(count, params) or 0)
            return [_message_pb(r.MessageRow) for r in rows], head, total

    async def set_head(self, owner: str, session_id: str, head_sequence: int) -> trace_pb2.Session:
        """Switches the trace to the branch ending at `head_sequence` (an existing message)."""
        async with self._tx() as db:
            row = await self._session(db, owner, session_id, lock=True)
            if head_sequence <= 0 or not await self._has_sequence(db, row.id, head_sequence):
                raise InvalidArgument(f"head_sequence {head_sequence} is not in the session")
            row.head_sequence = head_sequence
        return _session_pb(row, owner)

    async def get_trace(self, owner: str, session_id: str) -> tuple[trace_pb2.Session, int, int]:
        """(session, message_count, main_path_count)."""
        async with self._read() as db:
            row = await self._session(db, owner, session_id)
            count = await db.scalar(
                select(func.count()).select_from(MessageRow).where(MessageRow.session_id == row.id)
            )
            return _session_pb(row, owner), int(count or 0), await self._path_count(db, row)

    # ---- A2A tasks --------------------------------------------------------------------------------

    async def create_a2a_task(
        self,
        owner: str,
        callee_agent: str,
        caller_agent: str = "",
        caller_session_id: str = "",
        caller_context: dict[str, Any] | None = None,
        visible_in_sidebar: bool = False,
        continue_session_id: str = "",
    ) -> trace_pb2.A2ATask:
        """A task (state submitted) with the callee's hidden a2a session, new or continued."""
        _need_owner(owner)
        if not callee_agent:
            raise InvalidArgument("callee_agent is required")
        async with self._tx() as db:
            if caller_session_id:
                uid: int | None = (await self._session(db, owner, caller_session_id)).user_id
            else:
                uid = await self._user_id(db, owner, create=True)
            callee = await self._agent(db, callee_agent)
            assert callee is not None
            caller = await self._agent(db, caller_agent)
            now = _now()
            if continue_session_id:
                session = await self._session(db, owner, continue_session_id)
                if session.kind != "a2a":
                    raise FailedPrecondition("continue_session_id is not an a2a session")
                if session.agent != callee.slug:
                    raise InvalidArgument(f"session {continue_session_id} belongs to agent {session.agent!r}")
                session.updated_at = now
                if visible_in_sidebar:
                    session.visible_in_sidebar = 1
            else:
                session = SessionRow(
                    id=str(uuid.uuid4()),
                    user_id=uid,
                    agent=callee.slug,
                    kind="a2a",
                    visible_in_sidebar=int(visible_in_sidebar),
                    title=f"{caller.slug if caller else 'a2a'} -> {callee.slug}",
                    created_at=now,
                    updated_at=now,
                )
                db.add(session)
            task = A2ATaskRow(
                id=str(uuid.uuid4()),
                session=session,
                user_id=uid,
                caller_agent=caller,
                caller_session_id=caller_session_id or None,
                caller_context=caller_context,
                state="submitted",
                visible_in_sidebar=int(visible_in_sidebar),
                created_at=now,
                updated_at=now,
            )
            db.add(task)
            await db.flush()
            return _task_pb(task, owner)

    async def _task(self, db: AsyncSession, owner: str, task_id: str) -> A2ATaskRow:
        _need_owner(owner)
        if not task_id:
            raise InvalidArgument("task_id is required")
        row = await db.scalar(
            select(A2ATaskRow).where(
                A2ATaskRow.id == task_id,
                A2ATaskRow.user_id == select(User.id).where(User.name == owner).scalar_subquery(),
            )
        )
        if row is None:
            raise NotFound("task not found")
        return row

    async def update_a2a_task(self, owner: str, task_id: str, state: int) -> trace_pb2.A2ATask:
        """Changes the state; a terminal state (completed, canceled, failed, rejected) is final."""
        new = _name(_TASK_STATE, state, "state")
        async with self._tx() as db:
            row = await self._task(db, owner, task_id)
            if row.state != new:
                if row.state in TERMINAL_TASK_STATES:
                    raise FailedPrecondition(f"task is already {row.state}")
                row.state = new
                row.updated_at = _now()
            return _task_pb(row, owner)

    async def get_a2a_task(self, owner: str, task_id: str) -> trace_pb2.A2ATask:
        async with self._read() as db:
            return _task_pb(await self._task(db, owner, task_id), owner)

    async def list_a2a_tasks(self, owner: str, caller_session_id: str) -> list[trace_pb2.A2ATask]:
        """The tasks a caller session started, oldest first."""
        async with self._read() as db:
            await self._session(db, owner, caller_session_id)
            rows = await db.scalars(
                select(A2ATaskRow)
                .where(A2ATaskRow.caller_session_id == caller_session_id)
                .order_by(A2ATaskRow.created_at, A2ATaskRow.id)
            )
            return [_task_pb(r, owner) for r in rows]

    # ---- subagent sessions ------------------------------------------------------------------------

    async def create_subagent(self, owner: str, sub: trace_pb2.SubagentSession) -> trace_pb2.SubagentSession:
        """A subagent row (status queued unless given) anchored on an assistant message of the session,
        with the subagent's own hidden session (agent = the preset agent, else the parent agent)."""
        source_type = sub.source_type or ("preset" if sub.preset_agent else "clone")
        if source_type not in ("preset", "clone"):
            raise InvalidArgument("source_type must be preset or clone")
        status = enum_to_str(_SUB_STATUS, sub.status) or "queued"
        async with self._tx() as db:
            session = await self._session(db, owner, sub.session_id)
            anchor = await db.scalar(
                select(MessageRow.id).where(
                    MessageRow.id == sub.parent_message_id, MessageRow.session_id == session.id
                )
            )
            if anchor is None:
                raise InvalidArgument("parent_message_id is not a message of the session")
            parent_agent = await self._agent(db, sub.parent_agent or session.agent)
            preset_agent = await self._agent(db, sub.preset_agent)
            runner = preset_agent or parent_agent
            assert runner is not None
            now = _now()
            child = SessionRow(
                id=str(uuid.uuid4()),
                user_id=session.user_id,
                agent=runner.slug,
                kind="subagent",
                title=sub.name,
                created_at=now,
                updated_at=now,
            )
            db.add(child)
            row = SubagentRow(
                session_id=session.id,
                parent_message_id=anchor,
                parent_tool_call_id=sub.parent_tool_call_id or None,
                parent_agent=parent_agent,
                source_type=source_type,
                preset_agent=preset_agent,
                name=sub.name,
                goal=sub.goal,
                context=sub.context or None,
                status=status,
                model=sub.model,
                tool_names=list(sub.tool_names),
                summary=sub.summary or None,
                result_payload=_dict(sub.result_payload) if sub.HasField("result_payload") else None,
                error=sub.error or None,
                token_usage=_usage_dict(sub.token_usage) if sub.HasField("token_usage") else None,
                sort_order=sub.sort_order,
                started_at=sub.start_time.ToDatetime(UTC) if sub.HasField("start_time") else None,
                ended_at=sub.end_time.ToDatetime(UTC) if sub.HasField("end_time") else None,
                created_at=now,
                updated_at=now,
                child_session_id=child.id,
                batch_title=sub.batch_title,
            )
            db.add(row)
            await db.flush()
            return _subagent_pb(row)

    async def update_subagent(
        self, owner: str, sub: trace_pb2.SubagentSession, paths: Sequence[str]
    ) -> trace_pb2.SubagentSession:
        """Changes the fields in `paths`; status moves queued -> running -> completed | failed |
        cancelled (or queued -> failed | cancelled), anything else is FailedPrecondition."""
        _need_owner(owner)
        fields = _mask(paths, SUBAGENT_FIELDS)
        async with self._tx() as db:
            row = await self._owned_row(db, SubagentRow, sub.id, owner, "subagent session", lock=True)
            now = _now()
            if "status" in fields:
                new = _name(_SUB_STATUS, sub.status, "status")
                if new != row.status:
                    if new not in SUBAGENT_TRANSITIONS[row.status]:
                        raise FailedPrecondition(f"subagent cannot go from {row.status} to {new}")
                    row.status = new
                    if new == "running" and row.started_at is None:
                        row.started_at = now
                    if not SUBAGENT_TRANSITIONS[new] and row.ended_at is None:
                        row.ended_at = now
            if "model" in fields:
                row.model = sub.model
            if "tool_names" in fields:
                row.tool_names = list(sub.tool_names)
            if "summary" in fields:
                row.summary = sub.summary or None
            if "result_payload" in fields:
                row.result_payload = _dict(sub.result_payload) if sub.HasField("result_payload") else None
            if "error" in fields:
                row.error = sub.error or None
            if "token_usage" in fields:
                row.token_usage = _usage_dict(sub.token_usage) if sub.HasField("token_usage") else None
            if "start_time" in fields:
                row.started_at = sub.start_time.ToDatetime(UTC) if sub.HasField("start_time") else None
            if "end_time" in fields:
                row.ended_at = sub.end_time.ToDatetime(UTC) if sub.HasField("end_time") else None
            row.updated_at = now
            return _subagent_pb(row)

    async def get_subagent(self, owner: str, subagent_id: int) -> trace_pb2.SubagentSession:
        """One row of a session the owner owns (NotFound otherwise)."""
        _need_owner(owner)
        async with self._read() as db:
            row = await self._owned_row(db, SubagentRow, subagent_id, owner, "subagent session")
            return _subagent_pb(row)

    async def list_subagents(
        self, owner: str, session_id: str, parent_message_id: int = 0
    ) -> list[trace_pb2.SubagentSession]:
        """One anchor's rows by sort order; parent_message_id 0: every row of the session."""
        async with self._read() as db:
            session = await self._session(db, owner, session_id)
            stmt = select(SubagentRow).where(SubagentRow.session_id == session.id)
            if parent_message_id:
                stmt = stmt.where(SubagentRow.parent_message_id == parent_message_id)
            rows = await db.scalars(
                stmt.order_by(SubagentRow.parent_message_id, SubagentRow.sort_order, SubagentRow.id)
            )
            return [_subagent_pb(r) for r in rows]

    # ---- users and keys ---------------------------------------------------------------------------

    async def authenticate(self, api_key: str) -> str:
        """The user name behind an API key; Unauthenticated for an unknown one."""
        if not api_key:
            raise Unauthenticated("missing API key")
        async with self._tx() as db:
            found = (
                await db.execute(
                    select(ApiKey.id, User.name)
                    .join(User, User.id == ApiKey.user_id)
                    .where(ApiKey.key_hash == _hash_key(api_key))
                )
            ).first()
            if found is None:
                raise Unauthenticated("invalid API key")
            await db.execute(update(ApiKey).where(ApiKey.id == found.id).values(last_used_at=_now()))
            return str(found.name)

    async def create_api_key(self, user: str) -> str:
        """A fresh key for `user` (created when new); only its sha256 is stored, so it is shown once."""
        if not user or len(user) > 200:
            raise InvalidArgument("user must be 1-200 characters")
        key = "am_" + secrets.token_urlsafe(32)
        async with self._tx() as db:
            uid = await self._user_id(db, user, create=True)
            db.add(ApiKey(user_id=uid, key_hash=_hash_key(key), prefix=key[:10], created_at=_now()))
        return key
