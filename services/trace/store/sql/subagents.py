"""Subagent rows in SQL
(docs/requirements.md#subagent-rows), each with its own hidden trace; a batch in one transaction."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import bindparam, insert, select, update

from agentmesh.libs.errors import InvalidArgument, NotFound
from agentmesh.libs.ids import new_token_id
from agentmesh.services.trace.store.base import SubagentChange, SubagentStore
from agentmesh.services.trace.store.sql.append_writes import INSERT_MESSAGES, make_item, message_row, stored
from agentmesh.services.trace.store.sql.common import (
    AGENT_AS_READ,
    MESSAGES,
    SUB_SOURCE,
    SUB_STATUS,
    SUBAGENT_COLUMNS,
    SUBAGENTS,
    SUBAGENTS_WITH_AGENTS,
    TRACES,
    Database,
    from_struct,
    name_of,
    now,
    own_first,
    owned_by_param,
    subagent_from_values,
    subagent_pb,
    ts,
    usage_json,
)
from agentmesh.services.trace.store.sql.models import SubagentRow
from agentmesh.trace.v1 import trace_pb2 as tp

_SA = SUBAGENTS
# What a change may set (`SqlSubagentStore._store`): one executemany UPDATE writes them all.
_CHANGEABLE = (
    "status",
    "model",
    "tool_names",
    "summary",
    "result_payload",
    "error",
    "token_usage",
    "started_at",
    "ended_at",
    "updated_at",
)
# The message `:id` of trace `:trace`.
_ANCHOR = select(MESSAGES.c.id).where(
    MESSAGES.c.id == bindparam("id"), MESSAGES.c.trace_id == bindparam("trace")
)


def _time(field: str) -> Callable[[tp.SubagentSession], datetime | None]:
    return lambda row: getattr(row, field).ToDatetime(UTC) if row.HasField(field) else None


# A changed field of a row: its column, and its value there.
_COLUMN_OF: dict[str, tuple[str, Callable[[tp.SubagentSession], Any]]] = {
    "status": ("status", lambda row: name_of(SUB_STATUS, row.status, "status")),
    "model": ("model", lambda row: row.model),
    "tool_names": ("tool_names", lambda row: list(row.tool_names)),
    "summary": ("summary", lambda row: row.summary or None),
    "result_payload": ("result_payload", lambda row: from_struct(row, "result_payload")),
    "error": ("error", lambda row: row.error or None),
    "token_usage": (
        "token_usage",
        lambda row: usage_json(row.token_usage) if row.HasField("token_usage") else None,
    ),
    "start_time": ("started_at", _time("start_time")),
    "end_time": ("ended_at", _time("end_time")),
}


def _differs(a: tp.SubagentSession, b: tp.SubagentSession, field: str) -> bool:
    """Whether `field` differs (for a message field: set in one only, or to other values)."""
    if a.DESCRIPTOR.fields_by_name[field].message_type is not None and a.HasField(field) != b.HasField(field):
        return True
    return bool(getattr(a, field) != getattr(b, field))


_CREATED = tuple(c for c in _SA.c.keys() if c not in ("id", "lease_until"))  # what a new row is given
_INSERT_TRACES, _INSERT_ROWS = insert(TRACES), insert(_SA)
# The rows of a change, of the live traces of user `:owner`, locked (one statement: a cache key once).
_READ = (
    select(*SUBAGENT_COLUMNS)
    .select_from(SUBAGENTS_WITH_AGENTS.join(TRACES, TRACES.c.id == _SA.c.trace_id))
    .where(_SA.c.public_id.in_(bindparam("ids", expanding=True)), owned_by_param())
    .with_for_update(of=_SA)
)
_UPDATE = (
    update(_SA)
    .where(_SA.c.id == bindparam("u_id"))
    .values({c: bindparam(f"v_{c}", type_=_SA.c[c].type) for c in _CHANGEABLE})
)


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
        # Core statements in one transaction (a fan-out's path to its first child waits for it: no ORM
        # unit of work): the hidden traces in one INSERT, the rows in one, their turns in one.
        async with self.db.write_lock, self.db.engine.begin() as conn:
            traces: dict[str, Any] = {}  # id -> the trace row (id, user_id, agent)
            anchors: set[tuple[str, int]] = set()
            agents: dict[str, Any] = {}  # slug -> its row as read, or None: a batch names a few

            async def agent(slug: str, *, required: bool = True) -> Any:
                if slug not in agents:
                    params = {"slug": slug, "owner": owner}
                    agents[slug] = (
                        own_first((await conn.execute(AGENT_AS_READ, params)).all()) if slug else None
                    )
                if agents[slug] is None and slug and required:
                    raise InvalidArgument(f"unknown agent {slug!r}")
                return agents[slug]

            children: list[dict[str, Any]] = []
            created: list[dict[str, Any]] = []
            stamp = now()
            for sub in rows:
                source = name_of(SUB_SOURCE, sub.source_type, "source_type")
                status = name_of(SUB_STATUS, sub.status, "status")
                trace = traces.get(sub.trace_id)
                if trace is None:
                    trace = traces[sub.trace_id] = await self.db.owned_trace(conn, owner, sub.trace_id)
                if (trace.id, sub.parent_message_id) not in anchors:
                    anchor = await conn.scalar(_ANCHOR, {"id": sub.parent_message_id, "trace": trace.id})
                    if anchor is None:
                        raise InvalidArgument("parent_message_id is not a message of the trace")
                    anchors.add((trace.id, sub.parent_message_id))
                parent_agent = await agent(sub.parent_agent or trace.agent, required=False)
                preset_agent = await agent(sub.preset_agent)
                runner = preset_agent or parent_agent
                if runner is None:  # a clone, and neither the row nor its trace names an agent
                    raise InvalidArgument("a subagent needs an agent: preset_agent or parent_agent")
                child = str(uuid.uuid4())
                sequence = 2 if turns else 0
                children.append(
                    {
                        "id": child,
                        "user_id": trace.user_id,
                        "agent": runner.slug,
                        "kind": "subagent",
                        "title": sub.name,
                        "created_at": stamp,
                        "updated_at": stamp,
                        "last_sequence": sequence,
                        "head_sequence": sequence,
                    }
                )
                created.append(
                    {
                        "public_id": new_token_id(),
                        "trace_id": trace.id,
                        "parent_message_id": sub.parent_message_id,
                        "parent_tool_call_id": sub.parent_tool_call_id or None,
                        "parent_agent_id": parent_agent.id if parent_agent is not None else None,
                        "source_type": source,
                        "preset_agent_id": preset_agent.id if preset_agent is not None else None,
                        "name": sub.name,
                        "goal": sub.goal,
                        "context": sub.context or None,
                        "status": status,
                        "model": sub.model,
                        "tool_names": list(sub.tool_names),
                        "summary": None,
                        "result_payload": None,
                        "error": sub.error or None,
                        "token_usage": None,
                        "sort_order": sub.sort_order,
                        "started_at": None,
                        "ended_at": stamp if status == "failed" else None,
                        "created_at": stamp,
                        "updated_at": stamp,
                        "child_trace_id": child,
                        "batch_title": sub.batch_title,
                        "background": sub.background,
                        "parent_agent_slug": parent_agent.slug if parent_agent is not None else None,
                        "preset_agent_slug": preset_agent.slug if preset_agent is not None else None,
                    }
                )
            await conn.execute(_INSERT_TRACES, children)
            await conn.execute(_INSERT_ROWS, [{c: v[c] for c in _CREATED} for v in created])
            begun: list[tuple[tp.Message, tp.Message]] = []
            if turns:  # each hidden trace's first two messages, in one INSERT
                items, values = [], []
                for row, (user, placeholder) in zip(created, turns, strict=True):
                    for k, message in enumerate((user, placeholder)):
                        item = make_item(owner, message, None, row["child_trace_id"])
                        caller = await agent(message.caller_agent, required=False)
                        caller_id = caller.id if caller is not None else None
                        items.append((item, k + 1, k or None, caller_id))
                        values.append(message_row(item, k + 1, k or None, caller_id, stamp))
                ids = (await conn.execute(INSERT_MESSAGES, values)).scalars().all()
                out = [
                    stored(item, message_id, sequence, parent, caller_id, ts(stamp))
                    for (item, sequence, parent, caller_id), message_id in zip(items, ids, strict=True)
                ]
                begun = list(zip(out[::2], out[1::2], strict=True))
            return [subagent_from_values(v) for v in created], begun

    async def update_subagents(
        self, owner: str, changes: Sequence[tuple[str, SubagentChange]]
    ) -> list[tp.SubagentSession]:
        # Core statements in one transaction (a fan-out's rows settle on its fan-in's path: no ORM unit
        # of work): every row read at once, locked, of the traces `owner` owns; one UPDATE per row.
        ids = sorted({subagent_id for subagent_id, _ in changes})
        async with self.db.write_lock, self.db.engine.begin() as conn:
            found = {
                r.public_id: r._asdict() for r in await conn.execute(_READ, {"ids": ids, "owner": owner})
            }
            stamp = now()
            out = []
            for subagent_id, change in changes:
                stored = found.get(subagent_id)
                if stored is None:
                    raise NotFound("subagent session not found")
                current = subagent_from_values(stored)
                self._store(stored, current, change(current, stamp), stamp)
                out.append(subagent_from_values(stored))
            changed = [{"u_id": v["id"], **{f"v_{c}": v[c] for c in _CHANGEABLE}} for v in found.values()]
            await conn.execute(_UPDATE, changed)
            return out

    @staticmethod
    def _store(
        stored: dict[str, Any], current: tp.SubagentSession, new: tp.SubagentSession, stamp: datetime
    ) -> None:
        """What differs from `current` in `new`, into the row's values (`stored`); the update time moves."""
        for name, (column, value) in _COLUMN_OF.items():
            if _differs(current, new, name):
                stored[column] = value(new)
        stored["updated_at"] = stamp

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
            stmt = select(SubagentRow).where(SubagentRow.trace_id == trace.id)
            if parent_message_id:
                stmt = stmt.where(SubagentRow.parent_message_id == parent_message_id)
            rows = await db.scalars(
                stmt.order_by(
                    SubagentRow.created_at,
                    SubagentRow.parent_message_id,
                    SubagentRow.sort_order,
                    SubagentRow.id,
                )
            )
            return [subagent_pb(r) for r in rows]
