"""The statements a turn runs on the trace store find their rows by key, not by reading a whole table
or every trace of the user: their cost must not grow with the database nor with the user's history.

SQLite only: its planner decides without statistics, so a plan read from an empty file is the plan the
service runs at any size. (PostgreSQL plans by the tables' sizes, so an empty database says nothing.)
A plan step that reads a table whole (`SCAN messages`), or that lists what an `IN (SELECT ...)` of a
table names (`LIST SUBQUERY`: every trace of the user, on each execution), fails the test with the
statement.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from agentmesh.libs.errors import NotFound
from agentmesh.services.trace.store.base import MessageQuery
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.services.trace.store.sql.db import create_engine, migrate
from agentmesh.trace.v1 import trace_pb2 as tp

TABLES = "messages|traces|agents|users|api_keys|a2a_tasks|subagent_sessions"
FULL_SCAN = re.compile(rf"^SCAN ({TABLES})$")  # a table read whole (`SCAN x USING INDEX` reads an index)


class Recorded:
    """Every statement the engine runs, with its first set of parameters."""

    def __init__(self, engine: Any) -> None:
        self.statements: dict[str, tuple[Any, ...]] = {}
        event.listen(engine.sync_engine, "before_cursor_execute", self._execute)

    def _execute(self, conn: Any, cursor: Any, statement: str, parameters: Any, ctx: Any, many: bool) -> None:
        if many and parameters and isinstance(parameters[0], list | tuple):  # executemany: its first row
            parameters = parameters[0]
        self.statements.setdefault(statement, tuple(parameters or ()))


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[tuple[SqlStores, Recorded, Path]]:
    path = tmp_path / "plans.db"
    engine = create_engine(f"sqlite+aiosqlite:///{path}")
    await migrate(engine)
    yield SqlStores.open(engine), Recorded(engine), path
    await engine.dispose()


def bad_steps(path: Path, statements: dict[str, tuple[Any, ...]]) -> list[tuple[str, list[str]]]:
    conn = sqlite3.connect(path)
    try:
        out = []
        for sql, params in statements.items():
            if not sql.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE", "INSERT", "WITH")):
                continue
            steps = [row[3] for row in conn.execute(f"EXPLAIN QUERY PLAN {sql}", params)]
            # An IN list built from a table (the user's traces); one built from a CTE (a branch's path,
            # "CO-ROUTINE") is as long as what the statement returns.
            listed = any(
                step.startswith("LIST SUBQUERY") and not after.startswith("CO-ROUTINE")
                for step, after in itertools.pairwise(steps)
            )
            if listed or any(FULL_SCAN.match(step) for step in steps):
                out.append((" ".join(sql.split()), steps))
        return out
    finally:
        conn.close()


async def test_a_turns_statements_read_by_key(store):
    """A chat turn's store calls (its trace and two messages, its agent, the answer written back and read,
    the history read of the next turn, the copy check) and the reaper's sweep."""
    stores, recorded, path = store
    owner = "plans-user"
    trace, (user_msg, placeholder) = await stores.messages.create_trace_with_messages(
        owner,
        tp.Trace(agent="general"),
        "",
        [
            tp.Message(role=tp.MESSAGE_ROLE_USER, content="hi"),
            tp.Message(role=tp.MESSAGE_ROLE_ASSISTANT, status=tp.MESSAGE_STATUS_PENDING),
        ],
    )
    with contextlib.suppress(NotFound):
        await stores.agents.get_agent(owner, "general")
    answer = tp.Message(id=placeholder.id, content="hello", status=tp.MESSAGE_STATUS_COMPLETED)
    await stores.messages.update_message(owner, answer, ["content", "status"])
    assert (await stores.messages.get_message(owner, placeholder.id)).content == "hello"
    await stores.traces.get_trace(owner, trace.id)
    query = MessageQuery(trace_id=trace.id, head_sequence=placeholder.sequence, limit=10)
    page = await stores.messages.list_messages(owner, query)
    assert [m.id for m in page.messages] == [user_msg.id, placeholder.id]
    await stores.copies.of_trace(owner, trace.id)
    await stores.leases.reap(100)

    assert len(recorded.statements) >= 8, recorded.statements
    assert bad_steps(path, recorded.statements) == []
