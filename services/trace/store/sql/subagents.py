"""Subagent rows in SQL (seed 3 section 5), each with its own hidden trace; a batch in one transaction."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.trace.v1 import trace_pb2 as tp
from libs.errors import FailedPrecondition, InvalidArgument, NotFound
from libs.ids import new_token_id
from libs.protojson import enum_to_str
from services.trace import domain
from services.trace.domain import need_owner
from services.trace.store.base import SubagentStore
from services.trace.store.sql.appends import INSERT_MESSAGES, make_item, message_row, stored
from services.trace.store.sql.common import (
    SUB_SOURCE,
    SUB_STATUS,
    Database,
    from_struct,
    name_of,
    now,
    number_of,
    subagent_pb,
    ts,
    usage_json,
)
from services.trace.store.sql.models import AgentRow, MessageRow, SessionRow, SubagentRow


class SqlSubagentStore(SubagentStore):
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create_subagents(
        self,
        owner: str,
        rows: Sequence[tp.SubagentSession],
        turns: Sequence[tuple[tp.Message, tp.Message]] = (),
    ) -> tuple[list[tp.SubagentSession], list[tuple[tp.Message, tp.Message]]]:
        if not rows:
            return [], []
        if turns and len(turns) != len(rows):
            raise InvalidArgument("give one turn per subagent, or none")
        async with self.db.tx() as db:
            traces: dict[str, SessionRow] = {}
            anchors: set[tuple[str, int]] = set()
            agents: dict[str, AgentRow | None] = {}  # a batch names the same few agents, each read once

            async def agent(slug: str, *, required: bool = True) -> AgentRow | None:
                if slug not in agents:
                    agents[slug] = await self.db.agent_row(db, owner, slug, required=False)
                if agents[slug] is None and slug and required:
                    raise InvalidArgument(f"unknown agent {slug!r}")
                return agents[slug]

            created: list[SubagentRow] = []
            stamp = now()
            for sub in rows:
                source = enum_to_str(SUB_SOURCE, sub.source_type) or (
                    "preset" if sub.preset_agent else "clone"
                )
                status = enum_to_str(SUB_STATUS, sub.status) or "queued"
                if status not in ("queued", "failed"):
                    raise InvalidArgument("a subagent starts queued (or failed, with its error)")
                trace = traces.get(sub.trace_id) or await self.db.trace_row(db, owner, sub.trace_id)
                traces[trace.id] = trace
                if (trace.id, sub.parent_message_id) not in anchors:
                    anchor = await db.scalar(
                        select(MessageRow.id).where(
                            MessageRow.id == sub.parent_message_id, MessageRow.session_id == trace.id
                        )
                    )
                    if anchor is None:
                        raise InvalidArgument("parent_message_id is not a message of the trace")
                    anchors.add((trace.id, sub.parent_message_id))
                parent_agent = await agent(sub.parent_agent or trace.agent, required=False)
                preset_agent = await agent(sub.preset_agent)
                runner = preset_agent or parent_agent
                if runner is None:  # a clone, and neither the row nor its trace names an agent
                    raise InvalidArgument("a subagent needs an agent: preset_agent or parent_agent")
                child = SessionRow(
                    id=str(uuid.uuid4()),
                    user_id=trace.user_id,
                    agent=runner.slug,
                    kind="subagent",
                    title=sub.name,
                    created_at=stamp,
                    updated_at=stamp,
                    last_sequence=2 if turns else 0,
                    head_sequence=2 if turns else 0,
                )
                db.add(child)
                row = SubagentRow(
                    public_id=new_token_id(),
                    session_id=trace.id,
                    parent_message_id=sub.parent_message_id,
                    parent_tool_call_id=sub.parent_tool_call_id or None,
                    parent_agent=parent_agent,
                    source_type=source,
                    preset_agent=preset_agent,
                    name=sub.name,
                    goal=sub.goal,
                    context=sub.context or None,
                    status=status,
                    model=sub.model,
                    tool_names=list(sub.tool_names),
                    error=sub.error or None,
                    sort_order=sub.sort_order,
                    ended_at=stamp if status == "failed" else None,
                    created_at=stamp,
                    updated_at=stamp,
                    child_session_id=child.id,
                    batch_title=sub.batch_title,
                )
                db.add(row)
                created.append(row)
            await db.flush()
            begun: list[tuple[tp.Message, tp.Message]] = []
            if turns:  # each hidden trace's first two messages, in one INSERT
                items, values = [], []
                for row, (user, placeholder) in zip(created, turns, strict=True):
                    for k, message in enumerate((user, placeholder)):
                        item = make_item(owner, message, None, row.child_session_id or "")
                        caller = await agent(message.caller_agent, required=False)
                        caller_id = caller.id if caller is not None else None
                        items.append((item, k + 1, k or None, caller_id))
                        values.append(message_row(item, k + 1, k or None, caller_id, stamp))
                ids = (await db.execute(INSERT_MESSAGES, values)).scalars().all()
                out = [
                    stored(item, message_id, sequence, parent, caller_id, ts(stamp))
                    for (item, sequence, parent, caller_id), message_id in zip(items, ids, strict=True)
                ]
                begun = list(zip(out[::2], out[1::2], strict=True))
            return [subagent_pb(r) for r in created], begun

    async def update_subagent(
        self, owner: str, row: tp.SubagentSession, paths: Sequence[str]
    ) -> tp.SubagentSession:
        return (await self.update_subagents(owner, [(row, paths)]))[0]

    async def update_subagents(
        self, owner: str, updates: Sequence[tuple[tp.SubagentSession, Sequence[str]]]
    ) -> list[tp.SubagentSession]:
        masks = [domain.check_mask(paths, domain.SUBAGENT_FIELDS) for _, paths in updates]
        need_owner(owner)
        async with self.db.tx() as db:
            # Every row in one read (not one read each), locked, of the traces `owner` owns.
            stmt = (
                select(SubagentRow)
                .join(SessionRow, SessionRow.id == SubagentRow.session_id)
                .where(SubagentRow.public_id.in_({row.id for row, _ in updates}), self.db.owned(owner))
                .with_for_update(of=SubagentRow)
            )
            found = {r.public_id: r for r in (await db.scalars(stmt)).all()}
            stamp = now()
            out = []
            for (row, _), fields in zip(updates, masks, strict=True):
                stored = found.get(row.id)
                if stored is None:
                    raise NotFound("subagent session not found")
                out.append(self._apply(stored, row, fields, stamp))
            return out

    @staticmethod
    def _apply(
        stored: SubagentRow, row: tp.SubagentSession, fields: set[str], stamp: datetime
    ) -> tp.SubagentSession:
        """One row's change (its transaction writes it); the status moves only forward."""
        if "status" in fields:
            new = name_of(SUB_STATUS, row.status, "status")
            old = number_of(SUB_STATUS, stored.status)
            if new != stored.status:
                if row.status not in domain.SUBAGENT_MOVES[old]:
                    raise FailedPrecondition(f"subagent cannot go from {stored.status} to {new}")
                stored.status = new
                if row.status == ev.SUBAGENT_STATUS_RUNNING and stored.started_at is None:
                    stored.started_at = stamp
                if not domain.SUBAGENT_MOVES[row.status] and stored.ended_at is None:
                    stored.ended_at = stamp
        if "model" in fields:
            stored.model = row.model
        if "tool_names" in fields:
            stored.tool_names = list(row.tool_names)
        if "summary" in fields:
            stored.summary = row.summary or None
        if "result_payload" in fields:
            stored.result_payload = from_struct(row, "result_payload")
        if "error" in fields:
            stored.error = row.error or None
        if "token_usage" in fields:
            stored.token_usage = usage_json(row.token_usage) if row.HasField("token_usage") else None
        stored.updated_at = stamp
        return subagent_pb(stored)

    async def get_subagent(self, owner: str, subagent_id: str) -> tp.SubagentSession:
        async with self.db.read() as db:
            return subagent_pb(
                await self.db.owned_row(
                    db, SubagentRow, SubagentRow.public_id == subagent_id, owner, "subagent session"
                )
            )

    async def list_subagents(
        self, owner: str, trace_id: str, parent_message_id: int = 0
    ) -> list[tp.SubagentSession]:
        async with self.db.read() as db:
            trace = await self.db.trace_row(db, owner, trace_id)
            stmt = select(SubagentRow).where(SubagentRow.session_id == trace.id)
            if parent_message_id:
                stmt = stmt.where(SubagentRow.parent_message_id == parent_message_id)
            rows = await db.scalars(
                stmt.order_by(SubagentRow.parent_message_id, SubagentRow.sort_order, SubagentRow.id)
            )
            return [subagent_pb(r) for r in rows]
