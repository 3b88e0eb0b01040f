"""Message updates that arrive together: on SQLite written in one transaction of a few statements
(`UpdateBatcher`), on PostgreSQL one statement each; on both, every caller gets its own row as stored,
a missing, foreign or refused update fails only its caller, a caller that gave up breaks nobody, and
updates of one message apply in arrival order."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import event, text

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import NotFound
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.services.trace.store.sql.db import create_engine, migrate
from agentmesh.trace.v1 import trace_pb2 as tp

USER, ASSISTANT = tp.MESSAGE_ROLE_USER, tp.MESSAGE_ROLE_ASSISTANT
DONE, PENDING = tp.MESSAGE_STATUS_COMPLETED, tp.MESSAGE_STATUS_PENDING


class Statements:
    """The statements and transactions an engine runs (an executemany counts once)."""

    def __init__(self, engine: Any) -> None:
        self.sql: list[str] = []
        self.begins = 0
        event.listen(engine.sync_engine, "before_cursor_execute", self._execute)
        event.listen(engine.sync_engine, "begin", self._begin)

    def _execute(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        self.sql.append(" ".join(statement.split()))

    def _begin(self, conn: Any) -> None:
        self.begins += 1

    def reset(self) -> None:
        self.sql.clear()
        self.begins = 0

    def count(self, prefix: str) -> int:
        return sum(s.startswith(prefix) for s in self.sql)


@pytest.fixture
async def stores(empty_database: str) -> AsyncIterator[tuple[SqlStores, Statements, str]]:
    engine = create_engine(empty_database)
    await migrate(engine)
    yield SqlStores.open(engine), Statements(engine), engine.dialect.name
    await engine.dispose()


async def _messages(stores: SqlStores, owner: str, n: int) -> tuple[tp.Trace, list[tp.Message]]:
    trace = await stores.traces.create_trace(owner, tp.Trace(agent="general"), "")
    placeholders = [tp.Message(role=ASSISTANT, status=PENDING, content="") for _ in range(n)]
    out = await stores.messages.append_messages(owner, trace.id, placeholders)
    return await stores.traces.get_trace(owner, trace.id), out


def _change(i: int, m: tp.Message) -> tuple[tp.Message, list[str]]:
    """One of three kinds of update (three sets of columns), by i."""
    if i % 3 == 0:
        return tp.Message(id=m.id, content=f"answer {i}"), ["content"]
    if i % 3 == 1:
        usage = ev.Usage(input_tokens=i, output_tokens=2 * i)
        return tp.Message(id=m.id, content=f"answer {i}", status=DONE, usage=usage), [
            "content",
            "status",
            "usage",
        ]
    meta = tp.Message(id=m.id, model=f"model-{i}")
    meta.metadata.update({"i": i, "tags": ["a", "b"]})
    return meta, ["metadata", "model"]


async def test_concurrent_updates_each_return_their_own_row_in_one_transaction(stores):
    """30 updates of 30 messages of two users at once: each caller gets its message as stored, each
    trace's updated_at moves; on SQLite all of them are one transaction with one UPDATE per set of
    columns, one SELECT and one UPDATE of the traces."""
    s, statements, dialect = stores
    (ta, ma), (tb, mb) = await _messages(s, "alice", 15), await _messages(s, "bob", 15)
    owners = ["alice"] * 15 + ["bob"] * 15
    changes = [_change(i, m) for i, m in enumerate(ma + mb)]
    statements.reset()
    got = await asyncio.gather(
        *(s.messages.update_message(o, c, paths) for o, (c, paths) in zip(owners, changes, strict=True))
    )
    if dialect == "sqlite":
        assert statements.begins == 1, statements.sql
        assert statements.count("UPDATE messages") == 3
        assert statements.count("SELECT") == 1
        assert statements.count("UPDATE traces") == 1
    for i, (owner, message, (change, _)) in enumerate(zip(owners, got, changes, strict=True)):
        assert message == await s.messages.get_message(owner, change.id), i
        assert message.id == change.id and message.role == ASSISTANT
        if i % 3 == 0:
            assert (message.content, message.status) == (f"answer {i}", PENDING)
        elif i % 3 == 1:
            assert (message.content, message.status) == (f"answer {i}", DONE)
            assert (message.usage.input_tokens, message.usage.output_tokens) == (i, 2 * i)
        else:
            assert (message.model, dict(message.metadata)) == (f"model-{i}", {"i": i, "tags": ["a", "b"]})
            assert message.content == ""
    for owner, before in (("alice", ta), ("bob", tb)):
        after = await s.traces.get_trace(owner, before.id)
        assert after.update_time.ToDatetime() > before.update_time.ToDatetime()


async def test_a_missing_or_foreign_message_fails_only_its_caller(stores):
    s, _, _ = stores
    _, mine = await _messages(s, "alice", 6)
    theirs_trace, theirs = await _messages(s, "bob", 1)
    calls = [
        s.messages.update_message("alice", tp.Message(id=m.id, content="mine"), ["content"]) for m in mine
    ]
    foreign = s.messages.update_message("alice", tp.Message(id=theirs[0].id, content="stolen"), ["content"])
    missing = s.messages.update_message("alice", tp.Message(id=10**9, content="nowhere"), ["content"])
    *ok, stolen, nowhere = await asyncio.gather(*calls, foreign, missing, return_exceptions=True)
    assert [m if isinstance(m, BaseException) else m.content for m in ok] == ["mine"] * 6, ok
    assert isinstance(stolen, NotFound) and isinstance(nowhere, NotFound)
    assert str(stolen) == str(nowhere)  # the same answer: nothing tells bob's message exists
    assert (await s.messages.get_message("bob", theirs[0].id)).content == ""
    after = await s.traces.get_trace("bob", theirs_trace.id)
    assert after.update_time == theirs_trace.update_time


async def test_an_update_the_database_refuses_fails_only_its_caller(stores):
    s, _, dialect = stores
    _, messages = await _messages(s, "alice", 6)
    if dialect == "sqlite":
        refused = "refused"
        async with s.traces.db.engine.begin() as conn:
            await conn.execute(
                text(
                    "CREATE TRIGGER refuse BEFORE UPDATE OF content ON messages WHEN NEW.content = 'refused' "
                    "BEGIN SELECT RAISE(ABORT, 'refused'); END"
                )
            )
    else:
        refused = "nul \x00 inside"  # PostgreSQL refuses NUL in text
    contents = ["fine"] * 5 + [refused]
    results = await asyncio.gather(
        *(
            s.messages.update_message("alice", tp.Message(id=m.id, content=c), ["content"])
            for m, c in zip(messages, contents, strict=True)
        ),
        return_exceptions=True,
    )
    assert [m if isinstance(m, BaseException) else m.content for m in results[:5]] == ["fine"] * 5, results
    assert isinstance(results[5], Exception) and not isinstance(results[5], NotFound)
    stored = [await s.messages.get_message("alice", m.id) for m in messages]
    assert [m.content for m in stored] == ["fine"] * 5 + [""]


async def _until(condition: Any, what: str) -> None:
    """Yields to the loop until `condition()` holds (a deadline, not a sleep)."""
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0)


async def test_a_caller_that_gave_up_breaks_no_other(stores):
    """A caller cancelled while its update waits: the others are written, and so is nothing of its
    own (on SQLite, where it provably waits: a batch in flight holds the writer)."""
    s, _, dialect = stores
    _, messages = await _messages(s, "alice", 4)
    first, gone, *rest = messages

    def update(m: tp.Message, content: str) -> asyncio.Task[tp.Message]:
        return asyncio.ensure_future(
            s.messages.update_message("alice", tp.Message(id=m.id, content=content), ["content"])
        )

    batcher = s.messages.updates
    async with s.traces.db.write_lock:  # SQLite: the first batch waits for the writer
        in_flight = update(first, "first")
        if dialect == "sqlite":
            await _until(lambda: batcher._flushing and not batcher._pending, "the first batch taken")
        cancelled = update(gone, "never")
        later = [update(m, "later") for m in rest]
        if dialect == "sqlite":
            await _until(lambda: len(batcher._pending) == 3, "the next batch waiting")
        cancelled.cancel()
    assert (await in_flight).content == "first"
    assert [(await t).content for t in later] == ["later", "later"]
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    if dialect == "sqlite":
        assert (await s.messages.get_message("alice", gone.id)).content == ""
    assert not batcher._pending


async def test_updates_of_one_message_apply_in_arrival_order(stores):
    """Three updates of one message among others, at once: each caller reads back its own change. On
    SQLite they apply in arrival order, each caller reading the message as its own update left it (on
    PostgreSQL, concurrent connections, the order is the row lock's)."""
    s, statements, dialect = stores
    _, (target, *others) = await _messages(s, "alice", 4)
    first = s.messages.update_message("alice", tp.Message(id=target.id, content="one"), ["content"])
    second = s.messages.update_message(
        "alice", tp.Message(id=target.id, content="two", status=DONE), ["content", "status"]
    )
    around = [s.messages.update_message("alice", tp.Message(id=m.id, model="m"), ["model"]) for m in others]
    third = s.messages.update_message("alice", tp.Message(id=target.id, model="last"), ["model"])
    statements.reset()
    a, b, *c, d = await asyncio.gather(first, second, *around, third)
    assert a.content == "one" and (b.content, b.status) == ("two", DONE) and d.model == "last"
    assert [m.model for m in c] == ["m"] * 3
    batches = statements.begins
    stored = await s.messages.get_message("alice", target.id)
    if dialect == "sqlite":
        assert (a.content, a.status, a.model) == ("one", PENDING, "")
        assert (b.content, b.status, b.model) == ("two", DONE, "")
        assert (d.content, d.status, d.model) == ("two", DONE, "last")
        assert stored == d
        assert batches == 3  # one batch per update of the target; the others in the first
    else:
        assert stored in (a, b, d)  # what the last one written read back
