"""Leases of work in progress, in SQL: renewals, and the reaping of what an expired lease left behind.

A row's lease runs until `lease_until`; a row never renewed is covered for `lease_s` from its creation
(a placeholder) or its last change (a task, a subagent). Reaping settles expired rows in one
transaction (`FOR UPDATE SKIP LOCKED` on PostgreSQL, so reapers on several replicas never settle the
same row twice) and names the buffers they streamed to.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, bindparam, or_, select, update

from agentmesh.libs.ids import a2a_key, subagent_key, trace_key
from agentmesh.services.trace.store.base import LeaseStore, Reaped
from agentmesh.services.trace.store.sql.common import Database, chunks, now
from agentmesh.services.trace.store.sql.models import A2ATaskRow, MessageRow, SubagentRow, TraceRow

PENDING = ("pending",)
OPEN_TASK = ("submitted", "working")
OPEN_SUBAGENT = ("queued", "running")
INTERRUPTED = {"code": "interrupted", "message": "the process running this work stopped; it was settled"}


def _open(column: Any, states: tuple[str, ...]) -> Any:
    """`column IN (states)` written out, not bound: SQLite uses a partial index (`WHERE state IN
    ('submitted', 'working')`, the reaper's, migration 0003) only for a query naming the same values,
    and reads the whole table otherwise, finished rows and all. One value is `=` (`status = 'pending'`:
    an IN list of one is not matched to it)."""
    if len(states) == 1:
        return column == bindparam(f"open_{column.key}", states[0], literal_execute=True)
    return column.in_(bindparam(f"open_{column.key}", states, expanding=True, literal_execute=True))


def _expired(model: Any, since: Any, stamp: datetime, cutoff: datetime) -> Any:
    return or_(model.lease_until < stamp, and_(model.lease_until.is_(None), since < cutoff))


class SqlLeaseStore(LeaseStore):
    def __init__(self, db: Database, lease_s: float) -> None:
        self.db = db
        self.lease_s = lease_s

    async def renew(
        self, message_ids: Sequence[int], task_ids: Sequence[str], subagent_ids: Sequence[str]
    ) -> int:
        until = now() + timedelta(seconds=self.lease_s)
        renewed = 0
        async with self.db.tx() as db:
            for model, column, ids, status, states in (
                (MessageRow, MessageRow.id, message_ids, MessageRow.status, PENDING),
                (A2ATaskRow, A2ATaskRow.id, task_ids, A2ATaskRow.state, OPEN_TASK),
                (SubagentRow, SubagentRow.public_id, subagent_ids, SubagentRow.status, OPEN_SUBAGENT),
            ):
                for chunk in chunks(ids):
                    result = await db.execute(
                        update(model).where(column.in_(chunk), status.in_(states)).values(lease_until=until)
                    )
                    renewed += result.rowcount or 0  # type: ignore[attr-defined]
        return renewed

    def _locked(self, stmt: Any, of: Any) -> Any:
        return stmt if self.db.sqlite else stmt.with_for_update(of=of, skip_locked=True)

    async def reap(self, limit: int) -> Reaped:
        stamp = now()
        cutoff = stamp - timedelta(seconds=self.lease_s)
        out = Reaped()
        keys: set[str] = set()
        async with self.db.tx() as db:
            messages = (
                await db.execute(
                    self._locked(
                        select(MessageRow.id, MessageRow.trace_id, MessageRow.a2a_task_id, TraceRow.kind)
                        .join(TraceRow, TraceRow.id == MessageRow.trace_id)
                        .where(
                            _open(MessageRow.status, PENDING),
                            _expired(MessageRow, MessageRow.created_at, stamp, cutoff),
                        )
                        .limit(limit),
                        MessageRow,
                    )
                )
            ).all()
            for row in messages:
                stored = await db.get(MessageRow, row.id)
                assert stored is not None
                stored.status = "failed"
                stored.meta = {**(stored.meta or {}), "error": INTERRUPTED}
                stored.lease_until = None
                stored.ended_at = stamp
                if row.kind == "chat":
                    keys.add(trace_key(row.trace_id))
                elif row.kind == "a2a" and row.a2a_task_id:
                    keys.add(a2a_key(row.a2a_task_id))
                elif row.kind == "subagent":
                    sub = await db.scalar(
                        select(SubagentRow.public_id).where(SubagentRow.child_trace_id == row.trace_id)
                    )
                    if sub:
                        keys.add(subagent_key(sub))
            out.messages = len(messages)
            tasks = (
                await db.scalars(
                    self._locked(
                        select(A2ATaskRow)
                        .where(
                            _open(A2ATaskRow.state, OPEN_TASK),
                            _expired(A2ATaskRow, A2ATaskRow.updated_at, stamp, cutoff),
                        )
                        .limit(limit),
                        A2ATaskRow,
                    )
                )
            ).all()
            for task in tasks:
                task.state, task.updated_at, task.lease_until = "failed", stamp, None
                keys.add(a2a_key(task.id))
            out.tasks = len(tasks)
            subagents = (
                await db.scalars(
                    self._locked(
                        select(SubagentRow)
                        .where(
                            _open(SubagentRow.status, OPEN_SUBAGENT),
                            _expired(SubagentRow, SubagentRow.updated_at, stamp, cutoff),
                        )
                        .limit(limit),
                        SubagentRow,
                    )
                )
            ).all()
            for sub in subagents:
                sub.status, sub.error = "failed", f"interrupted: {INTERRUPTED['message']}"
                sub.ended_at = sub.updated_at = stamp
                sub.lease_until = None
                keys.add(subagent_key(sub.public_id))
            out.subagents = len(subagents)
        out.stream_keys = sorted(keys)
        return out
