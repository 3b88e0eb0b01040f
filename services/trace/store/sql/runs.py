"""Runs in SQL: one statement over the owner's assistant messages, joined to what started each (its
trace, the subagent row whose hidden trace it runs in, the A2A task it answers, the caller agent).
A run's state and kind are the domain's (`domain.run_state`, `domain.run_kind`); the filters here say
the same in SQL."""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import ColumnElement, Table, and_, func, or_, select

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.services.trace import domain
from agentmesh.services.trace.domain import Cursor
from agentmesh.services.trace.store.base import RunQuery, RunStore
from agentmesh.services.trace.store.sql.common import (
    AGENTS,
    MESSAGES,
    MSG_STATUS,
    SOURCE,
    SUBAGENTS,
    TRACES,
    Database,
    number_of,
    ts,
)
from agentmesh.services.trace.store.sql.models import A2ATaskRow
from agentmesh.trace.v1 import trace_pb2 as tp

_M, _S, _A, _SUB = MESSAGES, TRACES, AGENTS, SUBAGENTS
_T = cast(Table, A2ATaskRow.__table__)
_ERROR_CODE = _M.c.metadata[("error", "code")].as_string()
_CALLER_TRACE = func.coalesce(_M.c.caller_trace_id, "")

_COLUMNS = (
    _M.c.id,
    _M.c.trace_id,
    _M.c.status,
    _M.c.source,
    _M.c.model,
    _M.c.input_tokens,
    _M.c.output_tokens,
    _M.c.a2a_task_id,
    _M.c.caller_trace_id,
    _M.c.created_at,
    _M.c.ended_at,
    _ERROR_CODE.label("error_code"),
    _M.c.metadata[("error", "message")].as_string().label("error_message"),
    _S.c.agent,
    _S.c.title,
    _A.c.slug.label("caller_agent_slug"),
    _SUB.c.public_id.label("subagent_id"),
    _SUB.c.trace_id.label("supervisor_trace_id"),
    _SUB.c.parent_message_id,
    _SUB.c.name.label("subagent_name"),
    _SUB.c.background,
    _T.c.caller_context,  # a few keys: toolCallId, depth, anchorMessageId
)
_FROM = (
    _M.join(_S, _S.c.id == _M.c.trace_id)
    .outerjoin(_A, _A.c.id == _M.c.caller_agent_id)
    .outerjoin(_SUB, _SUB.c.child_trace_id == _M.c.trace_id)
    .outerjoin(_T, _T.c.id == _M.c.a2a_task_id)
)

# The states (trace.proto RunState) and kinds (RunKind) as conditions on the message row.
_NOT_INTERRUPTED = or_(_ERROR_CODE.is_(None), _ERROR_CODE != domain.INTERRUPTED_CODE)
_STATES: dict[int, ColumnElement[bool]] = {
    tp.RUN_STATE_RUNNING: _M.c.status == "pending",
    tp.RUN_STATE_DONE: _M.c.status == "completed",
    tp.RUN_STATE_CANCELLED: _M.c.status == "cancelled",
    tp.RUN_STATE_FAILED: and_(_M.c.status == "failed", _NOT_INTERRUPTED),
    tp.RUN_STATE_INTERRUPTED: and_(_M.c.status == "failed", _ERROR_CODE == domain.INTERRUPTED_CODE),
}
_KINDS: dict[int, ColumnElement[bool]] = {
    tp.RUN_KIND_CHAT: _M.c.source == "user",
    tp.RUN_KIND_SUBAGENT: _M.c.source == "subagent",
    tp.RUN_KIND_CALLEE: and_(_M.c.source == "a2a", _CALLER_TRACE != ""),
    tp.RUN_KIND_A2A: and_(_M.c.source == "a2a", _CALLER_TRACE == ""),
}


def _anchor(context: dict[str, Any] | None) -> int:
    """The caller's anchor message id a task's context keeps (a JSON number), or 0."""
    value = (context or {}).get("anchorMessageId")
    try:
        return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0
    except (ValueError, OverflowError):
        return 0


def run_from_row(row: Any) -> tp.Run:
    """A run from a row of the statement above."""
    kind = domain.run_kind(number_of(SOURCE, row.source), row.caller_trace_id or "")
    parent_trace, parent_message = "", 0
    if kind == tp.RUN_KIND_SUBAGENT:
        parent_trace, parent_message = row.supervisor_trace_id or "", row.parent_message_id or 0
    elif kind == tp.RUN_KIND_CALLEE:
        parent_trace, parent_message = row.caller_trace_id or "", _anchor(row.caller_context)
    return tp.Run(
        message_id=row.id,
        trace_id=row.trace_id,
        kind=kind,  # type: ignore[arg-type]
        state=domain.run_state(number_of(MSG_STATUS, row.status), row.error_code or ""),  # type: ignore[arg-type]
        agent=row.agent,
        title=row.subagent_name if kind == tp.RUN_KIND_SUBAGENT and row.subagent_name else row.title,
        parent_trace_id=parent_trace,
        parent_message_id=parent_message,
        task_id=row.a2a_task_id or "",
        subagent_id=row.subagent_id or "" if kind == tp.RUN_KIND_SUBAGENT else "",
        caller_agent=row.caller_agent_slug or "",
        model=row.model,
        usage=ev.Usage(input_tokens=row.input_tokens, output_tokens=row.output_tokens),
        start_time=ts(row.created_at),
        end_time=ts(row.ended_at),
        error=row.error_message or "",
        background=bool(row.background) if kind == tp.RUN_KIND_SUBAGENT else False,
    )


class SqlRunStore(RunStore):
    def __init__(self, db: Database) -> None:
        self.db = db

    async def list_runs(self, owner: str, query: RunQuery, limit: int, after: Cursor | None) -> list[tp.Run]:
        where: list[ColumnElement[bool]] = [
            _S.c.user_id == self.db.owner_uid(owner),
            _S.c.deleted_at.is_(None),
            _S.c.home.is_(None),  # a cached copy of a peer's trace holds the peer's runs, not ours
            _M.c.role == "assistant",
        ]
        if query.state:
            where.append(_STATES[query.state])
        if query.kind:
            where.append(_KINDS[query.kind])
        if query.agent:
            where.append(_S.c.agent == query.agent)
        if after is not None:
            last = int(after.id)
            where.append(
                or_(_M.c.created_at < after.time, and_(_M.c.created_at == after.time, _M.c.id < last))
            )
        stmt = (
            select(*_COLUMNS)
            .select_from(_FROM)
            .where(*where)
            .order_by(_M.c.created_at.desc(), _M.c.id.desc())
            .limit(limit)
        )

        async def work(conn: Any) -> list[tp.Run]:
            return [run_from_row(r) for r in await conn.execute(stmt)]

        return await self.db.run(work)
