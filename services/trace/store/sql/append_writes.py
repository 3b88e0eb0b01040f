"""The writes of an append batch (`appends.AppendBatcher`): each item's next sequence, the head and the
row. On PostgreSQL that is one statement and one round trip for a whole batch: the items are passed
as arrays, checked (the owner's trace, the parent; the caller agent is linked when it is one),
numbered per trace in arrival order, the traces' rows locked in id order (`FOR NO KEY UPDATE`, so rows
that only reference a trace are not blocked), bumped and the messages inserted, all in one `WITH`
statement that commits on its own. On SQLite the same steps run as a few statements in one
transaction under the process's single writer. A new trace's first messages need no counter: one
INSERT (`write_first`).

Each write returns the items it wrote (index -> the stored message); an item it left out (its trace is
not the owner's, its parent is not in the trace) is not written, nor is any item of its group.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from google.protobuf import json_format
from sqlalchemy import TextClause, bindparam, insert, select, text, update
from sqlalchemy.dialects.postgresql.asyncpg import dialect as asyncpg_dialect
from sqlalchemy.ext.asyncio import AsyncConnection

from agentmesh.libs.errors import InvalidArgument
from agentmesh.libs.ids import MAX_MESSAGE_ID, new_message_id
from agentmesh.libs.protojson import enum_to_str
from agentmesh.services.trace.store.sql.common import (
    AGENTS,
    MESSAGES,
    MSG_STATUS,
    ROLE,
    SOURCE,
    TRACES,
    USERS,
    driver_fetch,
    name_of,
    ts,
)
from agentmesh.trace.v1 import trace_pb2 as tp

_M, _S, _A, _U = MESSAGES, TRACES, AGENTS, USERS


def _loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


@dataclass(eq=False)
class Item:
    """One message to append, checked for what needs no database."""

    owner: str
    trace_id: str
    message: tp.Message
    parent: int | None  # None: after the head; 0: a new root; n: after message n
    role: str
    source: str
    status: str
    meta: str | None  # the metadata as JSON text
    group: int = 0  # items of a group are written all or none, consecutively
    future: asyncio.Future[tp.Message] = field(default_factory=lambda: _loop().create_future())


def make_item(owner: str, message: tp.Message, parent: int | None, trace_id: str = "") -> Item:
    """An item of `message` (of `trace_id`, else its own trace) as its row stores it."""
    tid = trace_id or message.trace_id
    if not 0 <= message.id < MAX_MESSAGE_ID:
        raise InvalidArgument(f"a message id is below 2**53, not {message.id}")
    if not message.id:  # the caller may name it (the owner of a turn does); else a random one
        message.id = new_message_id()
    meta = None
    if message.HasField("metadata"):
        meta = json.dumps(json_format.MessageToDict(message.metadata), separators=(",", ":"))
    return Item(
        owner=owner,
        trace_id=tid,
        message=message,
        parent=parent,
        role=name_of(ROLE, message.role, "message role"),
        source=enum_to_str(SOURCE, message.source) or "user",
        status=enum_to_str(MSG_STATUS, message.status) or "completed",
        meta=meta,
    )


def stored(
    item: Item, message_id: int, sequence: int, parent: int | None, agent_id: int | None, created: Any
) -> tp.Message:
    """The message as stored (what a read of it returns): the item's message (every field of it is
    stored) with what the database gave it; `created` is the batch's create_time. A caller agent that
    is not (or no longer) an agent is provenance the row does not link: it reads back empty."""
    out = tp.Message()
    out.CopyFrom(item.message)
    out.id = message_id
    out.trace_id = item.trace_id
    out.sequence = sequence
    out.parent_sequence = parent or 0
    out.source = out.source or tp.MESSAGE_SOURCE_USER
    out.status = out.status or tp.MESSAGE_STATUS_COMPLETED
    out.usage.SetInParent()
    out.create_time.CopyFrom(created)
    if agent_id is None:
        out.caller_agent = ""
    return out


# ---- PostgreSQL: one statement per batch ------------------------------------------------------------

_COLUMNS = (
    ("ord", "int"),
    ("mid", "bigint"),
    ("grp", "int"),
    ("sid", "text"),
    ("owner", "text"),
    ("parent", "bigint"),
    ("role", "text"),
    ("content", "text"),
    ("thinking", "text"),
    ("meta", "text"),
    ("model", "text"),
    ("tin", "bigint"),
    ("tout", "bigint"),
    ("status", "text"),
    ("source", "text"),
    ("task", "text"),
    ("agent", "text"),
    ("csid", "text"),
)

PG_APPEND = text(
    f"""
WITH items AS (
  SELECT * FROM unnest({", ".join(f"CAST(:{n} AS {t}[])" for n, t in _COLUMNS)})
    AS i({", ".join(n for n, _ in _COLUMNS)})
),
checked AS (
  SELECT i.*, ag.id AS agent_id,
         (s.id IS NOT NULL AND u.id IS NOT NULL AND s.user_id IS NOT DISTINCT FROM u.id
          AND (i.parent IS NULL OR i.parent = 0 OR EXISTS (
                 SELECT 1 FROM messages m WHERE m.trace_id = i.sid AND m.sequence = i.parent))) AS ok
  FROM items i
  LEFT JOIN users u ON u.name = i.owner
  -- the trace by its id alone, then its owner compared (`OFFSET 0`: never merged into the join, where
  -- the planner could look it up by owner instead and read every trace of that user per item)
  LEFT JOIN LATERAL (
    SELECT s.id, s.user_id FROM traces s WHERE s.id = i.sid AND s.deleted_at IS NULL OFFSET 0
  ) s ON true
  LEFT JOIN LATERAL (
    SELECT g.id FROM agents g
    WHERE i.agent <> '' AND g.slug = i.agent AND (g.owner_user_id IS NULL OR g.owner_user_id = u.id)
    ORDER BY g.owner_user_id IS NULL LIMIT 1
  ) ag ON true
),
valid AS (
  SELECT c.*, row_number() OVER (PARTITION BY c.sid ORDER BY c.ord) AS k,
         count(*) OVER (PARTITION BY c.sid) AS n
  FROM (SELECT checked.*, bool_and(ok) OVER (PARTITION BY grp) AS group_ok FROM checked) c
  WHERE c.group_ok
),
locked AS (
  -- `= ANY` of the parameter: an index lookup however few rows the planner thinks traces holds
  -- (`IN (SELECT sid FROM valid)` alone was planned as a scan of traces per valid row).
  SELECT s.id, s.last_sequence, s.head_sequence FROM traces s
  WHERE s.id = ANY(CAST(:sid AS text[])) AND s.id IN (SELECT sid FROM valid) AND s.deleted_at IS NULL
  ORDER BY s.id
  FOR NO KEY UPDATE
),
bumped AS (
  UPDATE traces s
  SET last_sequence = l.last_sequence + c.n, head_sequence = l.last_sequence + c.n, updated_at = :now
  FROM locked l JOIN (SELECT DISTINCT sid, n FROM valid) c ON c.sid = l.id
  WHERE s.id = l.id
),
placed AS (  -- each valid item's sequence and parent, joined once (not again per inserted row)
  SELECT v.*, l.last_sequence + v.k AS seq,
         CASE WHEN v.parent IS NULL THEN
                CASE WHEN v.k = 1 THEN NULLIF(l.head_sequence, 0) ELSE l.last_sequence + v.k - 1 END
              WHEN v.parent = 0 THEN NULL
              ELSE v.parent END AS after
  FROM valid v JOIN locked l ON l.id = v.sid
),
inserted AS (
  INSERT INTO messages (id, trace_id, sequence, parent_sequence, role, content, thinking, metadata,
                        model, input_tokens, output_tokens, sort_order, status, source, a2a_task_id,
                        caller_agent_id, caller_trace_id, created_at)
  SELECT p.mid, p.sid, p.seq, p.after, p.role, p.content, p.thinking, CAST(p.meta AS json), p.model,
         p.tin, p.tout, 0, p.status, p.source, NULLIF(p.task, ''), p.agent_id, NULLIF(p.csid, ''), :now
  FROM placed p
  RETURNING id, trace_id, sequence, parent_sequence, caller_agent_id
)
SELECT p.ord, ins.id, ins.sequence, ins.parent_sequence, ins.caller_agent_id
FROM inserted ins JOIN placed p ON p.sid = ins.trace_id AND p.seq = ins.sequence
"""
)


# One item: the same steps with scalar parameters, which PostgreSQL plans once (the batch statement
# is planned for its arrays at every run, which only pays off when they hold several items).
PG_APPEND_ONE = text(
    """
WITH locked AS (
  SELECT s.id, s.user_id, s.last_sequence, s.head_sequence FROM traces s
  WHERE s.id = :sid AND s.deleted_at IS NULL
    AND s.user_id = (SELECT u.id FROM users u WHERE u.name = :owner)
    AND (CAST(:parent AS bigint) IS NULL OR CAST(:parent AS bigint) = 0 OR EXISTS (
           SELECT 1 FROM messages m WHERE m.trace_id = :sid AND m.sequence = CAST(:parent AS bigint)))
  FOR NO KEY UPDATE
),
bumped AS (
  UPDATE traces s
  SET last_sequence = l.last_sequence + 1, head_sequence = l.last_sequence + 1, updated_at = :now
  FROM locked l
  WHERE s.id = l.id
)
INSERT INTO messages (id, trace_id, sequence, parent_sequence, role, content, thinking, metadata,
                      model, input_tokens, output_tokens, sort_order, status, source, a2a_task_id,
                      caller_agent_id, caller_trace_id, created_at)
SELECT :mid, l.id, l.last_sequence + 1,
       CASE WHEN CAST(:parent AS bigint) IS NULL THEN NULLIF(l.head_sequence, 0)
            ELSE NULLIF(CAST(:parent AS bigint), 0) END,
       :role, :content, :thinking, CAST(:meta AS json), :model, :tin, :tout, 0, :status, :source,
       NULLIF(:task, ''),
       (SELECT g.id FROM agents g
        WHERE :agent <> '' AND g.slug = :agent AND (g.owner_user_id IS NULL OR g.owner_user_id = l.user_id)
        ORDER BY g.owner_user_id IS NULL LIMIT 1),
       NULLIF(:csid, ''), :now
FROM locked l
RETURNING id, sequence, parent_sequence, caller_agent_id
"""
)


def _driver_form(statement: TextClause) -> tuple[str, tuple[str, ...]]:
    """`statement` as asyncpg takes it, and the names of its $n parameters in order."""
    compiled = statement.compile(dialect=asyncpg_dialect())
    return str(compiled), tuple(compiled.positiontup or ())


PG_APPEND_SQL, _APPEND_NAMES = _driver_form(PG_APPEND)
PG_APPEND_ONE_SQL, _APPEND_ONE_NAMES = _driver_form(PG_APPEND_ONE)


def pg_params(items: Sequence[Item], stamp: datetime) -> dict[str, Any]:
    cols: dict[str, list[Any]] = {n: [] for n, _ in _COLUMNS}
    for i, it in enumerate(items):
        m = it.message
        for name, value in (
            ("ord", i),
            ("mid", m.id),
            ("grp", it.group),
            ("sid", it.trace_id),
            ("owner", it.owner),
            ("parent", it.parent),
            ("role", it.role),
            ("content", m.content),
            ("thinking", m.thinking),
            ("meta", it.meta),
            ("model", m.model),
            ("tin", m.usage.input_tokens),
            ("tout", m.usage.output_tokens),
            ("status", it.status),
            ("source", it.source),
            ("task", m.a2a_task_id),
            ("agent", m.caller_agent),
            ("csid", m.caller_trace_id),
        ):
            cols[name].append(value)
    return {**cols, "now": stamp}


async def pg_write(conn: AsyncConnection, items: Sequence[Item], stamp: datetime) -> dict[int, tp.Message]:
    """Index in `items` -> the stored message, for every item written."""
    params = pg_params(items, stamp)
    if len(items) == 1:
        (it,) = items
        one = {k: v if k == "now" else v[0] for k, v in params.items()}
        found = await driver_fetch(conn, PG_APPEND_ONE_SQL, [one[n] for n in _APPEND_ONE_NAMES])
        if not found:
            return {}
        message_id, sequence, parent, agent = found[0]
        return {0: stored(it, message_id, sequence, parent, agent, ts(stamp))}
    rows = await driver_fetch(conn, PG_APPEND_SQL, [params[n] for n in _APPEND_NAMES])
    created = ts(stamp)
    return {
        ord_: stored(items[ord_], message_id, sequence, parent, agent, created)
        for ord_, message_id, sequence, parent, agent in rows
    }


# ---- SQLite: the same steps under its single writer -------------------------------------------------

INSERT_MESSAGES = insert(_M).returning(_M.c.id, sort_by_parameter_order=True)


def message_row(
    it: Item, sequence: int, parent: int | None, agent: int | None, stamp: datetime
) -> dict[str, Any]:
    """The messages row of an item placed at `sequence` after `parent`."""
    m = it.message
    return {
        "id": m.id,
        "trace_id": it.trace_id,
        "sequence": sequence,
        "parent_sequence": parent,
        "role": it.role,
        "content": m.content,
        "thinking": m.thinking,
        "metadata": None if it.meta is None else json.loads(it.meta),
        "model": m.model,
        "input_tokens": m.usage.input_tokens,
        "output_tokens": m.usage.output_tokens,
        "sort_order": 0,
        "status": it.status,
        "source": it.source,
        "a2a_task_id": m.a2a_task_id or None,
        "caller_agent_id": agent,
        "caller_trace_id": m.caller_trace_id or None,
        "created_at": stamp,
    }


_SQLITE_BUMP = (
    update(_S)
    .where(_S.c.id == bindparam("b_id"))
    .values(
        last_sequence=bindparam("b_last"), head_sequence=bindparam("b_last"), updated_at=bindparam("b_now")
    )
)


async def sqlite_write(
    conn: AsyncConnection, items: Sequence[Item], stamp: datetime
) -> dict[int, tp.Message]:
    """What `PG_APPEND` does, as statements in the caller's transaction (SQLite has one writer)."""
    sids = sorted({it.trace_id for it in items})
    traces = {
        r.id: r
        for r in await conn.execute(
            select(_S.c.id, _S.c.user_id, _S.c.last_sequence, _S.c.head_sequence, _U.c.name)
            .join(_U, _U.c.id == _S.c.user_id)
            .where(_S.c.id.in_(sids), _S.c.deleted_at.is_(None))
        )
    }
    slugs = sorted({it.message.caller_agent for it in items if it.message.caller_agent})
    agents: dict[tuple[str, Any], int] = {}
    if slugs:
        found = await conn.execute(select(_A.c.id, _A.c.slug, _A.c.owner_user_id).where(_A.c.slug.in_(slugs)))
        agents = {(r.slug, r.owner_user_id): r.id for r in found}
    asked = [(it.trace_id, it.parent) for it in items if it.parent]
    parents: set[tuple[str, int]] = set()
    if asked:
        found = await conn.execute(
            select(_M.c.trace_id, _M.c.sequence).where(
                _M.c.trace_id.in_(sorted({sid for sid, _ in asked})),
                _M.c.sequence.in_(sorted({p for _, p in asked if p is not None})),
            )
        )
        parents = {(r.trace_id, r.sequence) for r in found}

    def agent_of(it: Item) -> int | None:
        slug, trace = it.message.caller_agent, traces[it.trace_id]
        return agents.get((slug, trace.user_id), agents.get((slug, None))) if slug else None

    def ok(it: Item) -> bool:
        trace = traces.get(it.trace_id)
        return (
            trace is not None
            and trace.name == it.owner
            and (not it.parent or (it.trace_id, it.parent) in parents)
        )

    bad_groups = {it.group for it in items if not ok(it)}
    last = {sid: traces[sid].last_sequence for sid in sids if sid in traces}
    head = {sid: traces[sid].head_sequence for sid in sids if sid in traces}
    rows: list[dict[str, Any]] = []
    placed: list[tuple[int, int, int | None, int | None]] = []  # (index, sequence, parent, agent)
    for index, it in enumerate(items):
        if it.group in bad_groups:
            continue
        sid = it.trace_id
        sequence = last[sid] + 1
        parent = (head[sid] or None) if it.parent is None else (it.parent or None)
        last[sid] = head[sid] = sequence
        agent = agent_of(it)
        rows.append(message_row(it, sequence, parent, agent, stamp))
        placed.append((index, sequence, parent, agent))
    if not rows:
        return {}
    ids = (await conn.execute(INSERT_MESSAGES, rows)).scalars().all()
    bumps = [
        {"b_id": sid, "b_last": last[sid], "b_now": stamp}
        for sid in sids
        if sid in last and last[sid] != traces[sid].last_sequence
    ]
    await conn.execute(_SQLITE_BUMP, bumps)
    created = ts(stamp)
    return {
        index: stored(items[index], message_id, sequence, parent, agent, created)
        for (index, sequence, parent, agent), message_id in zip(placed, ids, strict=True)
    }


# ---- the first messages of a new trace -----------------------------------------------------------------


async def write_first(conn: AsyncConnection, items: Sequence[Item], stamp: datetime) -> dict[int, tp.Message]:
    """The first messages of a trace this transaction just created with `last_sequence` = `head_sequence`
    = len(items) (both backends): sequences 1..n, each after the one before, in one INSERT (nothing to
    read: no counter, no head, no parent to check). Items naming a caller agent are not for this."""
    assert not any(it.message.caller_agent for it in items), "a caller agent needs write()"
    rows = [message_row(it, k + 1, k or None, None, stamp) for k, it in enumerate(items)]
    ids = (await conn.execute(INSERT_MESSAGES, rows)).scalars().all()
    created = ts(stamp)
    return {k: stored(it, ids[k], k + 1, k or None, None, created) for k, it in enumerate(items)}
