"""What the SQL stores share: units of work, owner-checked lookups, and the ORM <-> protobuf mapping
(`*_pb` build a message from a row; the stores write rows from messages)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, TypeVar, cast

from google.protobuf import json_format, struct_pb2, timestamp_pb2
from sqlalchemy import ColumnElement, Row, Table, and_, bindparam, exists, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import InvalidArgument, NotFound, Unavailable
from agentmesh.libs.protojson import enum_to_str, str_to_enum
from agentmesh.services.trace.domain import aware
from agentmesh.services.trace.store.sql.db import session_factory
from agentmesh.services.trace.store.sql.models import (
    A2ATaskRow,
    AgentRow,
    MessageRow,
    SubagentRow,
    TraceRow,
    User,
)
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)
CHUNK = 500  # ids per IN (...) clause

KIND = tp.TraceKind.DESCRIPTOR
ROLE = tp.MessageRole.DESCRIPTOR
SOURCE = tp.MessageSource.DESCRIPTOR
MSG_STATUS = tp.MessageStatus.DESCRIPTOR
TASK_STATE = tp.TaskState.DESCRIPTOR
SUB_STATUS = ev.SubagentStatus.DESCRIPTOR
SUB_SOURCE = ev.SubagentSource.DESCRIPTOR


def now() -> datetime:
    return datetime.now(UTC)


def chunks(ids: Iterable[Any]) -> Iterable[list[Any]]:
    items = list(ids)
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


def name_of(enum: Any, number: int, what: str) -> str:
    """The stored name of a proto enum value; InvalidArgument when unset or unknown."""
    name = enum_to_str(enum, number)
    if not name:
        raise InvalidArgument(f"{what} is required")
    return name


def number_of(enum: Any, name: str) -> Any:
    """A stored enum name back to its proto number."""
    return str_to_enum(enum, name)


def ts(dt: datetime | None) -> timestamp_pb2.Timestamp | None:
    if dt is None:
        return None
    out = timestamp_pb2.Timestamp()
    out.FromDatetime(aware(dt))
    return out


def to_struct(data: dict[str, Any] | None) -> struct_pb2.Struct | None:
    if data is None:
        return None
    out = struct_pb2.Struct()
    out.update(data)
    return out


def from_struct(msg: Any, field: str) -> dict[str, Any] | None:
    """The JSON of a Struct field, None when unset."""
    return json_format.MessageToDict(getattr(msg, field)) if msg.HasField(field) else None


def usage_json(usage: ev.Usage) -> dict[str, int]:
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}


def usage_pb(data: dict[str, Any] | None) -> ev.Usage | None:
    if data is None:
        return None
    return ev.Usage(
        input_tokens=int(data.get("input_tokens", 0)), output_tokens=int(data.get("output_tokens", 0))
    )


def trace_pb(row: Any, owner: str) -> tp.Trace:  # a TraceRow, or a Core row of TRACES
    return tp.Trace(
        id=row.id,
        owner=owner,
        agent=row.agent,
        kind=number_of(KIND, row.kind),
        visible_in_sidebar=bool(row.visible_in_sidebar),
        head_sequence=row.head_sequence,
        title=row.title,
        create_time=ts(row.created_at),
        update_time=ts(row.updated_at),
        home=row.home or "",
        sync_time=ts(row.synced_at),
    )


def message_pb(row: MessageRow) -> tp.Message:
    return _message(row, row.caller_agent.slug if row.caller_agent else "")


def _message(row: Any, caller_agent: str) -> tp.Message:
    """A message from an ORM row or a row of `message_columns` (they differ in the caller's slug). A
    message of a cached copy shows its home's id and caller agent."""
    return tp.Message(
        id=row.home_id or row.id,
        trace_id=row.trace_id,
        sequence=row.sequence,
        parent_sequence=row.parent_sequence or 0,
        role=number_of(ROLE, row.role),
        content=row.content,
        thinking=row.thinking,
        metadata=to_struct(row.meta),
        model=row.model,
        usage=ev.Usage(input_tokens=row.input_tokens, output_tokens=row.output_tokens),
        source=number_of(SOURCE, row.source),
        a2a_task_id=row.a2a_task_id or "",
        caller_agent=caller_agent or row.home_caller_agent or "",
        caller_trace_id=row.caller_trace_id or "",
        status=number_of(MSG_STATUS, row.status),
        create_time=ts(row.created_at),
    )


# The tables, for Core statements.
MESSAGES = cast(Table, MessageRow.__table__)
TRACES = cast(Table, TraceRow.__table__)
AGENTS = cast(Table, AgentRow.__table__)
USERS = cast(Table, User.__table__)
_M, _A = MESSAGES, AGENTS


def message_columns(m: Any = _M) -> tuple[Any, ...]:
    """A message as Core columns of `m` (the table, or a CTE returning its rows), with its caller
    agent's slug from `agents` joined on caller_agent_id: no ORM objects on the hot paths."""
    return (
        m.c.id,
        m.c.trace_id,
        m.c.sequence,
        m.c.parent_sequence,
        m.c.role,
        m.c.content,
        m.c.thinking,
        m.c.metadata.label("meta"),
        m.c.model,
        m.c.input_tokens,
        m.c.output_tokens,
        m.c.status,
        m.c.source,
        m.c.a2a_task_id,
        _A.c.slug.label("caller_agent_slug"),
        m.c.caller_trace_id,
        m.c.created_at,
        m.c.home_id,
        m.c.home_caller_agent,
    )


MESSAGE_COLUMNS = message_columns()
MESSAGES_WITH_AGENT = _M.outerjoin(_A, _A.c.id == _M.c.caller_agent_id)


def message_from_row(row: Row[Any]) -> tp.Message:
    """A message from a row of `message_columns`."""
    return _message(row, row.caller_agent_slug or "")


def task_pb(row: A2ATaskRow, owner: str) -> tp.A2ATask:
    return tp.A2ATask(
        id=row.id,
        trace_id=row.trace_id,
        callee_agent=row.trace.agent,
        caller_agent=row.caller_agent.slug if row.caller_agent else "",
        caller_trace_id=row.caller_trace_id or "",
        caller_context=to_struct(row.caller_context),
        state=number_of(TASK_STATE, row.state),
        visible_in_sidebar=bool(row.visible_in_sidebar),
        owner=owner,
        create_time=ts(row.created_at),
        update_time=ts(row.updated_at),
    )


def subagent_pb(row: SubagentRow) -> tp.SubagentSession:
    return _subagent(
        row,
        row.parent_agent.slug if row.parent_agent else "",
        row.preset_agent.slug if row.preset_agent else "",
    )


def _subagent(row: Any, parent_agent: str, preset_agent: str) -> tp.SubagentSession:
    """A subagent session from an ORM row or the values of a row of `SUBAGENT_COLUMNS` (they differ in
    the agents' slugs)."""
    return tp.SubagentSession(
        id=row.public_id,
        trace_id=row.trace_id,
        parent_message_id=row.parent_message_id,
        parent_tool_call_id=row.parent_tool_call_id or "",
        parent_agent=parent_agent,
        source_type=number_of(SUB_SOURCE, row.source_type),
        preset_agent=preset_agent,
        name=row.name,
        goal=row.goal,
        context=row.context or "",
        status=number_of(SUB_STATUS, row.status),
        model=row.model,
        tool_names=row.tool_names or [],
        summary=row.summary or "",
        result_payload=to_struct(row.result_payload),
        error=row.error or "",
        token_usage=usage_pb(row.token_usage),
        sort_order=row.sort_order,
        start_time=ts(row.started_at),
        end_time=ts(row.ended_at),
        create_time=ts(row.created_at),
        update_time=ts(row.updated_at),
        child_trace_id=row.child_trace_id or "",
        batch_title=row.batch_title,
        background=bool(row.background),
    )


def owner_id_param(param: str = "owner") -> Any:
    """The id of the user named by bind parameter `param`."""
    return select(USERS.c.id).where(USERS.c.name == bindparam(param)).scalar_subquery()


def owned_by_param(param: str = "owner") -> ColumnElement[bool]:
    """The live traces of the user named by bind parameter `param` (one statement for every owner)."""
    return and_(TRACES.c.user_id == owner_id_param(param), TRACES.c.deleted_at.is_(None))


def in_owned_trace(trace_id: ColumnElement[Any], owned: ColumnElement[bool]) -> ColumnElement[bool]:
    """`trace_id` names a trace that `owned` (`owned_by_param`, `Database.owned`) holds, read by the
    trace's key. (`IN (SELECT the owner's traces)` made SQLite list every trace the user ever had.)"""
    return exists().where(TRACES.c.id == trace_id, owned)


# The trace `:id` of user `:owner`, every column (`Database.owned_trace`): one statement, built once.
_OWNED_TRACE = select(*TRACES.c).where(TRACES.c.id == bindparam("id"), owned_by_param())


# The agent `:slug` as user `:owner` reads it: the built-in's row and the owner's own, if any
# (`own_first` picks). Core and built once: every turn, run and fan-out reads agents.
_AGENT_COLUMNS = ("id", "slug", "config", "version", "created_at", "updated_at")
AGENT_AS_READ = (
    select(*(AGENTS.c[c] for c in _AGENT_COLUMNS), USERS.c.name)
    .select_from(AGENTS.outerjoin(USERS, USERS.c.id == AGENTS.c.owner_user_id))
    .where(
        AGENTS.c.slug == bindparam("slug"),
        # the owner's id, not the join's `users.name`: both rows by the (owner, slug) key, no scan
        or_(AGENTS.c.owner_user_id.is_(None), AGENTS.c.owner_user_id == owner_id_param()),
    )
)


def own_first(rows: Sequence[Any]) -> Any:
    """Of the rows `AGENT_AS_READ` finds, the owner's own (it hides the built-in's); None if none."""
    return max(rows, key=lambda r: r.name is not None) if rows else None


SUBAGENTS = cast(Table, SubagentRow.__table__)
_PARENT, _PRESET = AGENTS.alias("parent_agent"), AGENTS.alias("preset_agent")
# A subagent row as Core columns, with its agents' slugs (`SUBAGENTS_WITH_AGENTS`): no ORM objects.
SUBAGENT_COLUMNS = (
    *SUBAGENTS.c,
    _PARENT.c.slug.label("parent_agent_slug"),
    _PRESET.c.slug.label("preset_agent_slug"),
)
SUBAGENTS_WITH_AGENTS = SUBAGENTS.outerjoin(_PARENT, _PARENT.c.id == SUBAGENTS.c.parent_agent_id).outerjoin(
    _PRESET, _PRESET.c.id == SUBAGENTS.c.preset_agent_id
)


def subagent_from_values(values: dict[str, Any]) -> tp.SubagentSession:
    """A subagent session from the values of a row of `SUBAGENT_COLUMNS` (`Row._asdict()`)."""
    return _subagent(
        SimpleNamespace(**values), values["parent_agent_slug"] or "", values["preset_agent_slug"] or ""
    )


R = TypeVar("R", MessageRow, SubagentRow, A2ATaskRow)
T = TypeVar("T")


_UNSENT = ("InterfaceError", "InternalClientError")  # asyncpg's: refused before anything was sent


def never_ran(exc: DBAPIError) -> bool:
    """Whether a statement that failed on a lost connection provably did nothing: the driver refused
    to send it (the connection was known closed), its protocol had not started the operation, the
    socket was already closed by the server when it was written (EPIPE), or the server said it was
    ending the session (57P01-03: what was running is rolled back). A connection that merely broke
    mid-statement is not among them: that statement may have committed."""
    seen: set[int] = set()
    cause: BaseException | None = exc.orig
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if str(getattr(cause, "sqlstate", "") or "").startswith("57P"):
            return True
        if isinstance(cause, BrokenPipeError):
            return True
        if type(cause).__module__.startswith("asyncpg") and type(cause).__name__ in _UNSENT:
            return True
        cause = cause.__cause__ or cause.__context__
    return False


async def driver_fetch(conn: AsyncConnection, sql: str, args: Sequence[Any]) -> list[Any]:
    """The rows of `sql` (in the driver's own form: asyncpg, $n parameters) run on `conn`'s asyncpg
    connection directly, from asyncpg's statement cache: a hot statement without the Core execution
    path (a batch of appends: 16 instead of 21 us of the trace process per message). It stays the
    engine's statement: its cursor listeners see it (`db.time_queries`, failed or not), and an error
    is the DBAPIError the engine raises, a lost connection invalidated (so that `Database.run`
    retries it or fails it as UNAVAILABLE)."""
    adapted: Any = (await conn.get_raw_connection()).dbapi_connection
    sync = conn.sync_connection
    assert sync is not None, "a connected AsyncConnection"
    sync.dispatch.before_cursor_execute(sync, None, sql, args, None, False)
    try:
        return list(await adapted.driver_connection.fetch(sql, *args))
    except Exception as exc:
        err: Exception = exc
        try:
            adapted._handle_exception(exc)  # raises the engine's DBAPI error for it
        except Exception as translated:
            err = translated
        dialect = conn.dialect
        lost = dialect.is_disconnect(cast(Any, err), adapted, None)
        if lost:
            await conn.invalidate(err)
        raise DBAPIError.instance(
            sql, args, err, dialect.loaded_dbapi.Error, connection_invalidated=lost, dialect=dialect
        ) from exc
    finally:
        sync.dispatch.after_cursor_execute(sync, None, sql, args, None, False)


class Database:
    """One engine and its session factory. SQLite writes are serialised by a per-process lock;
    PostgreSQL relies on row locks.

    `tx()` and `read()` are ORM units of work. The hot paths run Core statements with `run()`:
    on PostgreSQL without an explicit transaction (each statement commits on its own, so a write
    of one statement is one round trip), retried once on a connection found dead."""

    def __init__(self, engine: AsyncEngine, sessionmaker: async_sessionmaker[AsyncSession] | None = None):
        self.engine = engine
        self.sm = sessionmaker or session_factory(engine)
        self.sqlite = engine.dialect.name == "sqlite"
        self._write_lock = asyncio.Lock()
        self._uids: dict[str, int] = {}  # committed users' ids (a user's id never changes)
        # PostgreSQL: no BEGIN/COMMIT around single statements. SQLite keeps its default (its reads
        # start no transaction; writes go through `write_lock` and `engine.begin()`).
        self.auto = engine if self.sqlite else engine.execution_options(isolation_level="AUTOCOMMIT")

    @property
    def write_lock(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """SQLite's one writer per process (a no-op on PostgreSQL)."""
        return self._write_lock if self.sqlite else contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def tx(self) -> AsyncIterator[AsyncSession]:
        """One write unit of work."""
        async with self.write_lock, self.sm.begin() as db:
            yield db

    async def run(self, work: Callable[[AsyncConnection], Awaitable[T]], *, write: bool = False) -> T:
        """`work` on a connection of its own: on PostgreSQL each statement its own transaction, on
        SQLite a write runs under the write lock in one transaction. A unit that meets a dead
        connection is retried once on a fresh one when that is safe (a read, or a write that
        provably did nothing); otherwise it fails UNAVAILABLE."""
        for attempt in (1, 2):
            try:
                if self.sqlite and write:
                    async with self._write_lock, self.engine.begin() as conn:
                        return await work(conn)
                async with self.auto.connect() as conn:
                    return await work(conn)
            except DBAPIError as exc:
                if not exc.connection_invalidated:
                    raise
                if attempt == 1 and (not write or never_ran(exc)):
                    log.warning("database connection lost; retrying on a fresh one: %s", exc.orig)
                    continue
                raise Unavailable("the database connection was lost") from exc
        raise AssertionError("unreachable")

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        async with self.sm() as db:
            yield db

    def insert(self, table: Any) -> Any:
        return (sqlite.insert if self.sqlite else postgresql.insert)(table)

    async def user_id(self, conn: AsyncConnection | AsyncSession, name: str) -> int:
        """The id of user `name` (Core), created when new; an id read from a committed row is
        remembered (users are never deleted), one this transaction creates is not."""
        uid = self._uids.get(name)
        if uid is not None:
            return uid
        uid = await conn.scalar(select(USERS.c.id).where(USERS.c.name == name))
        if uid is not None:
            self._uids[name] = uid
            return int(uid)
        stmt = self.insert(USERS).values(name=name, created_at=now())
        await conn.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
        created = await conn.scalar(select(USERS.c.id).where(USERS.c.name == name))
        assert created is not None
        return int(created)

    @staticmethod
    def owner_uid(owner: str) -> Any:
        return select(User.id).where(User.name == owner).scalar_subquery()

    @classmethod
    def owned(cls, owner: str) -> ColumnElement[bool]:
        return and_(TraceRow.user_id == cls.owner_uid(owner), TraceRow.deleted_at.is_(None))

    @staticmethod
    async def owned_trace(conn: AsyncConnection, owner: str, trace_id: str) -> Any:
        """The trace `owner` owns (a Core row of every column); NotFound, like a missing one,
        otherwise."""
        row = (await conn.execute(_OWNED_TRACE, {"id": trace_id, "owner": owner})).first()
        if row is None:
            raise NotFound("trace not found")
        return row

    async def trace_row(self, db: AsyncSession, owner: str, trace_id: str, *, lock: bool = False) -> TraceRow:
        """The trace `owner` owns; NotFound, like a missing one, otherwise."""
        stmt = select(TraceRow).where(TraceRow.id == trace_id, self.owned(owner))
        if lock:
            stmt = stmt.with_for_update()
        row = await db.scalar(stmt)
        if row is None:
            raise NotFound("trace not found")
        return row

    async def owned_row(
        self, db: AsyncSession, model: type[R], where: Any, owner: str, what: str, *, lock: bool = False
    ) -> R:
        """A row (matched by `where`) of a trace `owner` owns (NotFound, like a missing one, otherwise)."""
        stmt = (
            select(model)
            .join(TraceRow, TraceRow.id == model.trace_id)  # type: ignore[attr-defined]
            .where(where, self.owned(owner))
        )
        if lock:
            stmt = stmt.with_for_update(of=model)
        row = await db.scalar(stmt)
        if row is None:
            raise NotFound(f"{what} not found")
        return row

    async def agent_row(
        self, db: AsyncSession, owner: str, slug: str, *, required: bool = True
    ) -> AgentRow | None:
        """The agent `slug` as `owner` sees it (their own, else the built-in); None for "". An unknown
        slug is InvalidArgument, or None when not `required`: a reference kept for provenance only (the
        caller of a run whose agent was deleted meanwhile), which its deletion would clear anyway."""
        if not slug:
            return None
        rows = (
            await db.scalars(
                select(AgentRow).where(
                    AgentRow.slug == slug,
                    or_(AgentRow.owner_user_id.is_(None), AgentRow.owner_user_id == self.owner_uid(owner)),
                )
            )
        ).all()
        if not rows:
            if not required:
                return None
            raise InvalidArgument(f"unknown agent {slug!r}")
        return max(rows, key=lambda r: r.owner_user_id is not None)
