"""Agent-invoke tasks in SQL (docs/requirements.md#invoke-task-rows), each with its callee's hidden trace."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from sqlalchemy import and_, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from agentmesh.services.trace.domain import Cursor
from agentmesh.services.trace.store.base import InboundTaskQuery, TaskStore
from agentmesh.services.trace.store.sql.common import (
    TASK_STATE,
    Database,
    from_struct,
    name_of,
    now,
    task_pb,
)
from agentmesh.services.trace.store.sql.models import A2ATaskRow, TraceRow, User
from agentmesh.trace.v1 import trace_pb2 as tp


class SqlTaskStore(TaskStore):
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create_task(self, owner: str, task: tp.A2ATask, continue_trace_id: str = "") -> tp.A2ATask:
        async with self.db.tx() as db:
            if task.caller_trace_id:
                uid: int | None = (await self.db.trace_row(db, owner, task.caller_trace_id)).user_id
            else:
                uid = await self.db.user_id(db, owner)
            remote_callee = task.callee_agent.startswith("@")  # a peer's agent: @alias/slug
            callee = None if remote_callee else await self.db.agent_row(db, owner, task.callee_agent)
            callee_slug = task.callee_agent if callee is None else callee.slug
            caller = await self.db.agent_row(db, owner, task.caller_agent, required=False)
            stamp = now()
            if continue_trace_id:
                trace = await self.db.trace_row(db, owner, continue_trace_id)
                trace.updated_at = stamp
                if task.visible_in_sidebar:
                    trace.visible_in_sidebar = 1
            else:
                trace = TraceRow(
                    id=str(uuid.uuid4()),
                    user_id=uid,
                    agent=callee_slug,
                    kind="a2a",
                    visible_in_sidebar=int(task.visible_in_sidebar),
                    title=f"{caller.slug if caller else 'a2a'} -> {callee_slug}",
                    created_at=stamp,
                    updated_at=stamp,
                )
                db.add(trace)
            row = A2ATaskRow(
                id=str(uuid.uuid4()),
                trace=trace,
                user_id=uid,
                caller_agent=caller,
                caller_trace_id=task.caller_trace_id or None,
                caller_context=from_struct(task, "caller_context"),
                state=name_of(TASK_STATE, task.state, "state"),
                visible_in_sidebar=int(task.visible_in_sidebar),
                created_at=stamp,
                updated_at=stamp,
            )
            db.add(row)
            await db.flush()
            return task_pb(row, owner)

    async def _task(self, db: AsyncSession, owner: str, task_id: str) -> A2ATaskRow:
        return await self.db.owned_row(db, A2ATaskRow, A2ATaskRow.id == task_id, owner, "task")

    async def update_task(
        self, owner: str, task_id: str, change: Callable[[tp.A2ATask], tp.A2ATask]
    ) -> tp.A2ATask:
        async with self.db.tx() as db:
            row = await self._task(db, owner, task_id)
            new = name_of(TASK_STATE, change(task_pb(row, owner)).state, "state")
            if row.state != new:
                row.state = new
                row.updated_at = now()
            return task_pb(row, owner)

    async def get_task(self, owner: str, task_id: str) -> tp.A2ATask:
        async with self.db.read() as db:
            return task_pb(await self._task(db, owner, task_id), owner)

    async def list_tasks(self, owner: str, caller_trace_id: str) -> list[tp.A2ATask]:
        async with self.db.read() as db:
            await self.db.trace_row(db, owner, caller_trace_id)
            rows = await db.scalars(
                select(A2ATaskRow)
                .where(A2ATaskRow.caller_trace_id == caller_trace_id)
                .order_by(A2ATaskRow.created_at, A2ATaskRow.id)
            )
            return [task_pb(r, owner) for r in rows]

    async def list_inbound_tasks(
        self, owner: str, query: InboundTaskQuery, limit: int, after: Cursor | None
    ) -> list[tp.A2ATask]:
        stmt = (
            select(A2ATaskRow)
            .join(User, User.id == A2ATaskRow.user_id)
            .where(User.name == owner, A2ATaskRow.caller_trace_id.is_(None))
        )
        if query.callee_agent:
            stmt = stmt.where(A2ATaskRow.trace.has(TraceRow.agent == query.callee_agent))
        if query.trace_id:
            stmt = stmt.where(A2ATaskRow.trace_id == query.trace_id)
        if query.state:
            stmt = stmt.where(A2ATaskRow.state == name_of(TASK_STATE, query.state, "state"))
        if after is not None:
            stmt = stmt.where(
                or_(
                    A2ATaskRow.created_at < after.time,
                    and_(A2ATaskRow.created_at == after.time, A2ATaskRow.id < after.id),
                )
            )
        stmt = stmt.order_by(A2ATaskRow.created_at.desc(), A2ATaskRow.id.desc()).limit(limit)
        async with self.db.read() as db:
            return [task_pb(r, owner) for r in await db.scalars(stmt)]
