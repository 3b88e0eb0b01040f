"""The append path: BeginTurn (a turn's two messages in one call), appends written together while a
batch is in flight (each caller still gets its own answer, ownership and order hold), and dead
database connections replaced without a ping on every checkout."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from typing import Any

import asyncpg
import grpc
import pytest

from agentmesh.libs import identity
from agentmesh.services.trace.store.base import Append
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.services.trace.store.sql.db import create_engine, migrate
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace.conftest import append, code_of, error_of, new_trace

USER, ASSISTANT = tp.MESSAGE_ROLE_USER, tp.MESSAGE_ROLE_ASSISTANT
MAIN, ALL = ms.PATH_MODE_MAIN_PATH, ms.PATH_MODE_ALL
BAD, MISSING = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


def _turn(trace_id: str, text: str, **kw) -> ms.BeginTurnRequest:
    return ms.BeginTurnRequest(
        trace_id=trace_id,
        user_message=tp.Message(role=USER, content=text, caller_agent=kw.pop("caller_agent", "")),
        assistant_message=tp.Message(role=ASSISTANT, status=tp.MESSAGE_STATUS_PENDING, model="mock-gpt"),
        **kw,
    )


async def _begin(stub, owner: str, request: ms.BeginTurnRequest) -> ms.BeginTurnResponse:
    with identity.acting_as(owner):
        return await stub.BeginTurn(request)


async def _all(stub, owner: str, trace_id: str) -> list[tp.Message]:
    with identity.acting_as(owner):
        page = await stub.ListMessages(ms.ListMessagesRequest(trace_id=trace_id, mode=ALL, limit=1000))
    return list(page.messages)


async def _main_path(stub, owner: str, trace_id: str) -> ms.ListMessagesResponse:
    with identity.acting_as(owner):
        return await stub.ListMessages(ms.ListMessagesRequest(trace_id=trace_id, mode=MAIN, limit=1000))


async def test_begin_turn_stores_the_user_message_and_the_placeholder_after_it(
    trace_stub, unique, message_stub
):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    first = await append(message_stub, owner, s.id, "earlier")
    turn = await _begin(message_stub, owner, _turn(s.id, "hello", caller_agent="general"))
    user, placeholder = turn.user_message, turn.assistant_message
    assert not turn.HasField("trace")
    assert (user.sequence, user.parent_sequence, user.role, user.content) == (
        2,
        first.sequence,
        USER,
        "hello",
    )
    assert (user.trace_id, user.caller_agent, user.status) == (s.id, "general", tp.MESSAGE_STATUS_COMPLETED)
    assert (placeholder.sequence, placeholder.parent_sequence, placeholder.role) == (3, 2, ASSISTANT)
    assert (placeholder.status, placeholder.model) == (tp.MESSAGE_STATUS_PENDING, "mock-gpt")
    # What BeginTurn answered is what is stored, field for field, and the head is the placeholder.
    path = await _main_path(message_stub, owner, s.id)
    assert list(path.messages) == [first, user, placeholder] and path.head_sequence == 3

    # A branch: the user message follows parent_sequence, the placeholder follows the user message.
    again = await _begin(message_stub, owner, _turn(s.id, "hello again", parent_sequence=first.sequence))
    assert (again.user_message.parent_sequence, again.assistant_message.parent_sequence) == (1, 4)
    path = await _main_path(message_stub, owner, s.id)
    assert [m.content for m in path.messages] == ["earlier", "hello again", ""]


async def test_begin_turn_creates_a_new_trace_with_both_messages(trace_stub, unique, message_stub):
    owner = f"u-{unique}"
    new = tp.Trace(agent="general", title="started by a turn", kind=tp.TRACE_KIND_CHAT)
    turn = await _begin(
        message_stub,
        owner,
        ms.BeginTurnRequest(
            new_trace=new,
            user_message=tp.Message(role=USER, content="first words"),
            assistant_message=tp.Message(role=ASSISTANT, status=tp.MESSAGE_STATUS_PENDING),
        ),
    )
    trace = turn.trace
    assert (trace.owner, trace.agent, trace.title, trace.head_sequence) == (owner, "general", new.title, 2)
    assert (turn.user_message.trace_id, turn.user_message.sequence, turn.user_message.parent_sequence) == (
        trace.id,
        1,
        0,
    )
    assert (turn.assistant_message.sequence, turn.assistant_message.parent_sequence) == (2, 1)
    with identity.acting_as(owner):
        stored = (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=trace.id))).trace
    assert stored == trace
    assert await _all(message_stub, owner, trace.id) == [turn.user_message, turn.assistant_message]
    # The trace's counter and head are at the placeholder: the next message follows it.
    follow = await append(message_stub, owner, trace.id, "next")
    assert (follow.sequence, follow.parent_sequence) == (3, 2)
    # A turn whose messages name a caller agent (a child turn): the same, with the provenance linked.
    child = await _begin(
        message_stub,
        owner,
        ms.BeginTurnRequest(
            new_trace=tp.Trace(agent="general"),
            user_message=tp.Message(role=USER, content="asked", caller_agent="general"),
            assistant_message=tp.Message(role=ASSISTANT, status=tp.MESSAGE_STATUS_PENDING),
        ),
    )
    assert (child.trace.head_sequence, child.user_message.caller_agent) == (2, "general")
    assert (await append(message_stub, owner, child.trace.id, "next")).sequence == 3

    # With an id of the caller's choosing; a taken id is refused and changes nothing.
    named = await _begin(
        message_stub, owner, _turn(f"t-{unique}", "named", new_trace=tp.Trace(agent="general"))
    )
    assert named.trace.id == f"t-{unique}"
    taken = _turn(f"t-{unique}", "again", new_trace=tp.Trace(agent="general"))
    assert await code_of(_begin(message_stub, owner, taken)) == grpc.StatusCode.ALREADY_EXISTS
    assert len(await _all(message_stub, owner, named.trace.id)) == 2
    # A new trace has nothing to follow.
    orphan = _turn("", "x", new_trace=tp.Trace(agent="general"), parent_sequence=1)
    assert await code_of(_begin(message_stub, owner, orphan)) == BAD


async def test_a_refused_turn_stores_neither_message(trace_stub, unique, message_stub):
    owner, other = f"u-{unique}", f"v-{unique}"
    s = await new_trace(trace_stub, owner)
    await append(message_stub, owner, s.id, "only")
    refusals = {
        "another user's trace": (other, _turn(s.id, "x"), MISSING),
        "a missing trace": (owner, _turn(f"nope-{unique}", "x"), MISSING),
        "an unknown parent": (owner, _turn(s.id, "x", parent_sequence=42), BAD),
        "no trace": (owner, _turn("", "x"), BAD),
    }
    for what, (who, request, code) in refusals.items():
        assert await code_of(_begin(message_stub, who, request)) == code, what
    no_role = _turn(s.id, "x")
    no_role.assistant_message.role = tp.MESSAGE_ROLE_UNSPECIFIED
    assert await code_of(_begin(message_stub, owner, no_role)) == BAD
    elsewhere = _turn(s.id, "x")
    elsewhere.user_message.trace_id = "another-trace"
    assert await code_of(_begin(message_stub, owner, elsewhere)) == BAD
    error = await error_of(_begin(message_stub, other, _turn(s.id, "x")))
    assert error.details() == "trace not found"  # the same answer as a missing trace
    # Nothing was stored and no sequence was used: the next append is 2.
    assert [m.sequence for m in await _all(message_stub, owner, s.id)] == [1]
    assert (await append(message_stub, owner, s.id, "next")).sequence == 2


async def test_concurrent_turns_and_appends_keep_each_turn_together(trace_stub, unique, message_stub):
    """20 turns and 20 single appends at once on one trace: every turn's placeholder right after its
    user message, every sequence used once, 1..60 without a gap."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    turns, singles = await asyncio.gather(
        asyncio.gather(*(_begin(message_stub, owner, _turn(s.id, f"turn {i}")) for i in range(20))),
        asyncio.gather(*(append(message_stub, owner, s.id, f"single {i}") for i in range(20))),
    )
    for t in turns:
        assert t.assistant_message.sequence == t.user_message.sequence + 1
        assert t.assistant_message.parent_sequence == t.user_message.sequence
    stored = await _all(message_stub, owner, s.id)
    assert [m.sequence for m in stored] == list(range(1, 61))
    # One chain: each message follows the one stored before it, and the head is the last.
    assert all(m.parent_sequence == m.sequence - 1 for m in stored)
    assert (await _main_path(message_stub, owner, s.id)).total == 60
    answered = {m.id: m for t in turns for m in (t.user_message, t.assistant_message)}
    answered.update({m.id: m for m in singles})
    assert {m.id: m for m in stored} == answered


REFUSED = "refused by the database"


async def refuse_on_postgres(trace_backend, content: str) -> None:
    """On PostgreSQL, a trigger that fails any insert of a message with `content`."""
    if trace_backend.name != "postgres":
        return
    conn = await asyncpg.connect(trace_backend.database_url)
    try:
        await conn.execute(
            f"""
            CREATE OR REPLACE FUNCTION refuse_test_content() RETURNS trigger AS $$
            BEGIN
              IF NEW.content = '{content}' THEN RAISE EXCEPTION 'refused'; END IF;
              RETURN NEW;
            END $$ LANGUAGE plpgsql;
            DROP TRIGGER IF EXISTS refuse_test_content ON messages;
            CREATE TRIGGER refuse_test_content BEFORE INSERT ON messages
              FOR EACH ROW EXECUTE FUNCTION refuse_test_content();
            """
        )
    finally:
        await conn.close()


async def test_nul_in_text_is_invalid_argument_on_both_databases(trace_stub, unique, message_stub):
    """Issue 39, point 4: PostgreSQL refused it (INTERNAL), SQLite stored it."""
    owner = f"u-{unique}"
    trace = await new_trace(trace_stub, owner)
    stored = await append(message_stub, owner, trace.id, "fine")
    cases: list[tuple[str, dict[str, Any]]] = [
        ("a\x00b", {}),
        ("ok", {"thinking": "\x00"}),
        ("ok", {"model": "m\x00"}),
    ]
    for content, extra in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await append(message_stub, owner, trace.id, content, **extra)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    with identity.acting_as(owner), pytest.raises(grpc.aio.AioRpcError) as updated:
        await message_stub.UpdateMessage(
            ms.UpdateMessageRequest(
                message=tp.Message(id=stored.id, content="\x00"), update_mask={"paths": ["content"]}
            )
        )
    assert updated.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_refused_appends_among_concurrent_ones_fail_alone(
    trace_stub, trace_backend, unique, message_stub
):
    """Appends written together: the ones for another user's trace answer NOT_FOUND, the ones after a
    missing parent INVALID_ARGUMENT, a message the database refuses fails its caller alone; none of
    them takes a sequence, and every other append is stored in one gap-free chain."""
    owner, other = f"u-{unique}", f"v-{unique}"
    mine, theirs = await new_trace(trace_stub, owner), await new_trace(trace_stub, other)
    await append(message_stub, owner, mine.id, "root")
    good = [append(message_stub, owner, mine.id, f"ok {i}") for i in range(30)]
    intruders = [append(message_stub, owner, theirs.id, f"intruder {i}") for i in range(10)]
    strays = [append(message_stub, owner, mine.id, f"stray {i}", parent=500 + i) for i in range(10)]
    # A statement-level failure of a batch: PostgreSQL refuses this content (a trigger; SQLite stores it).
    # (NUL, which PostgreSQL alone refused, is refused by the service on both now.)
    await refuse_on_postgres(trace_backend, REFUSED)
    nul = [append(message_stub, owner, mine.id, REFUSED)]
    results = await asyncio.gather(*good, *intruders, *strays, *nul, return_exceptions=True)
    ok, intruded, strayed, (odd,) = results[:30], results[30:40], results[40:50], results[50:]
    assert all(isinstance(m, tp.Message) for m in ok), ok
    assert {r.code() if isinstance(r, grpc.aio.AioRpcError) else None for r in intruded} == {MISSING}
    assert {r.code() if isinstance(r, grpc.aio.AioRpcError) else None for r in strayed} == {BAD}
    if trace_backend.name == "postgres":
        assert isinstance(odd, grpc.aio.AioRpcError) and odd.code() == grpc.StatusCode.INTERNAL
    else:
        assert isinstance(odd, tp.Message)
    stored = await _all(message_stub, owner, mine.id)
    expected = 31 + (trace_backend.name == "sqlite")
    assert [m.sequence for m in stored] == list(range(1, expected + 1))
    assert all(m.parent_sequence == m.sequence - 1 for m in stored[1:])
    assert await _all(message_stub, other, theirs.id) == []


# ---- connections the database closed -------------------------------------------------------------------


def _terminate(url: str, pids: list[int]) -> None:
    """Ends backends from outside this process, blocking: the test's loop reads nothing meanwhile."""
    sql = f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid IN ({','.join(map(str, pids))})"
    subprocess.run(["psql", url, "-qAtc", sql], check=True, capture_output=True, timeout=30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the server has let them go
        left = subprocess.run(
            ["psql", url, "-qAtc", sql.replace("pg_terminate_backend(pid)", "count(*)")],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        if left == "0":
            return
        time.sleep(0.05)
    raise AssertionError(f"backends {pids} did not end")


@pytest.fixture
async def pg_stores(trace_pg_url):
    """The trace stores on the suite's PostgreSQL database, with an engine of the test's own."""
    engine = create_engine(trace_pg_url)
    await migrate(engine)
    yield SqlStores.open(engine), engine
    await engine.dispose()


async def _pids(engine, n: int) -> list[int]:
    """Opens n pooled connections (all at once) and returns their backend pids."""
    from sqlalchemy import text

    conns = [await engine.connect() for _ in range(n)]
    try:
        return [int(await c.scalar(text("SELECT pg_backend_pid()"))) for c in conns]
    finally:
        for c in conns:
            await c.close()


async def test_a_dead_pooled_connection_is_retried_on_a_fresh_one(pg_stores, trace_pg_url, unique, caplog):
    """The server ends every pooled connection while the store is not looking (the loop has not
    even read the goodbye): the next append, update and read still succeed, without pinging."""
    caplog.set_level(logging.WARNING, "agentmesh.services.trace.store.sql.common")
    stores, engine = pg_stores
    owner = f"u-{unique}"
    trace = await stores.traces.create_trace(owner, tp.Trace(agent="general"), "")
    for round_ in range(3):
        pids = await _pids(engine, 3)
        _terminate(trace_pg_url, pids)  # blocking: the pool's sockets are closed but not yet read
        message = await stores.messages.append_message(
            owner, tp.Message(trace_id=trace.id, role=USER, content=f"after kill {round_}")
        )
        assert message.sequence == round_ + 1
    _terminate(trace_pg_url, await _pids(engine, 3))
    changed = await stores.messages.update_message(
        owner, tp.Message(id=message.id, content="changed"), ["content"]
    )
    assert changed.content == "changed"
    _terminate(trace_pg_url, await _pids(engine, 3))
    assert (await stores.messages.get_message(owner, message.id)).content == "changed"
    # Nothing was written twice, and the retry (not luck) got them through.
    count = await stores.traces.count_messages(owner, trace.id)
    assert count == (3, 3)
    assert any("retrying on a fresh one" in r.getMessage() for r in caplog.records)


async def test_a_driver_statement_is_the_engines(trace_pg_url, unique):
    """The batch statement runs on asyncpg directly (driver_fetch), yet as a statement of the engine:
    timed by its listeners, its errors the engine's DBAPIError, and the connection fine after one."""
    from prometheus_client import CollectorRegistry

    from agentmesh.libs.metrics import TraceStoreMetrics
    from agentmesh.services.trace.store.sql.db import time_queries

    engine = create_engine(trace_pg_url)
    registry = CollectorRegistry()
    time_queries(engine, TraceStoreMetrics(registry))  # as the service does: before the stores open
    await migrate(engine)
    stores = SqlStores.open(engine)
    try:
        await _driver_statements(stores, engine, registry, f"u-{unique}")
    finally:
        await engine.dispose()


async def _driver_statements(stores, engine, registry, owner: str) -> None:
    from sqlalchemy.exc import DBAPIError

    from agentmesh.services.trace.store.sql.common import driver_fetch

    def timed(operation: str) -> float:
        value = registry.get_sample_value("agentmesh_trace_query_seconds_count", {"operation": operation})
        return value or 0.0

    trace = await stores.traces.create_trace(owner, tp.Trace(agent="general"), "")
    before = timed("with")
    written = await stores.messages.append_each(
        [Append(owner, tp.Message(trace_id=trace.id, role=USER, content=f"m{i}"), None) for i in range(3)]
    )
    assert [m.sequence for m in written] == [1, 2, 3]  # type: ignore[union-attr]
    assert timed("with") > before
    async with engine.connect() as conn:
        before = timed("select")
        with pytest.raises(DBAPIError) as caught:
            await driver_fetch(conn, "SELECT 1 / $1::int", [0])
        assert not caught.value.connection_invalidated
        assert "division by zero" in str(caught.value.orig)
        assert timed("select") == before + 1  # timed, failed or not
        assert await driver_fetch(conn, "SELECT $1::int + 1", [1]) == [(2,)]
        assert not conn.invalidated


@pytest.mark.parametrize("trace_backend", ["postgres"], indirect=True)
async def test_the_service_survives_its_connections_being_killed(
    trace_stub, trace_backend, trace_pg_url, unique, message_stub
):
    """pg_terminate_backend on every connection of the trace service: its next calls succeed."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    await asyncio.gather(*(append(message_stub, owner, s.id, f"warm {i}") for i in range(20)))
    admin = await asyncpg.connect(trace_pg_url)
    try:
        listed = await admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
    finally:
        await admin.close()
    assert listed, "the service holds pooled connections"
    _terminate(trace_pg_url, [r["pid"] for r in listed])
    after = await asyncio.gather(*(append(message_stub, owner, s.id, f"after {i}") for i in range(20)))
    assert sorted(m.sequence for m in after) == list(range(21, 41))
    turn = await _begin(message_stub, owner, _turn(s.id, "still here"))
    assert turn.assistant_message.sequence == 42
