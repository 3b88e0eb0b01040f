"""services/trace/store/sql/appends.py, AppendBatcher: which appends go into which batch. The database
is a stand-in that records each batch and answers when the test says so; what the statements do is
tested against SQLite and PostgreSQL in tests/integration/trace/test_appends.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from agentmesh.services.trace.store.sql.append_writes import Item, make_item
from agentmesh.services.trace.store.sql.appends import AppendBatcher
from agentmesh.trace.v1 import trace_pb2 as tp


class FakeDb:
    """Database.run for the batcher: every batch waits for the test to release it."""

    sqlite = False

    def __init__(self) -> None:
        self.batches: list[list[str]] = []  # the contents of each batch, in the order they started
        self.gates: list[asyncio.Event] = []
        self.in_flight: list[set[str]] = []
        self.fail_on: set[str] = set()
        self.started = asyncio.Condition()

    async def run(self, work: Any, *, write: bool = False) -> Any:
        return await work(None)

    async def write(self, _conn: Any, items: Sequence[Item], _stamp: Any) -> dict[int, tp.Message]:
        traces = {it.trace_id for it in items}
        for other in self.in_flight:
            assert not traces & other, "two batches hold one trace"
        self.in_flight.append(traces)
        self.batches.append([it.message.content for it in items])
        gate = asyncio.Event()
        async with self.started:
            self.gates.append(gate)
            self.started.notify_all()
        try:
            await gate.wait()
        finally:
            self.in_flight.remove(traces)
        if any(it.message.content in self.fail_on for it in items):
            raise RuntimeError("the database refused the batch")
        return {
            i: tp.Message(trace_id=it.trace_id, content=it.message.content, sequence=i + 1)
            for i, it in enumerate(items)
        }

    async def release(self, n: int) -> None:
        """Waits until batch n has started, then lets it finish."""
        async with asyncio.timeout(5), self.started:
            await self.started.wait_for(lambda: len(self.gates) > n)
        self.gates[n].set()


def _batcher(db: FakeDb, **kw: Any) -> AppendBatcher:
    batcher = AppendBatcher(db, **kw)  # type: ignore[arg-type]
    batcher._write = db.write
    return batcher


def _items(trace: str, *contents: str) -> list[Item]:
    return [
        make_item("u", tp.Message(trace_id=trace, role=tp.MESSAGE_ROLE_USER, content=c), None)
        for c in contents
    ]


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_appends_that_arrive_during_a_batch_go_together_in_order():
    db = FakeDb()
    batcher = _batcher(db, max_flushes=1)
    first = asyncio.ensure_future(batcher.append(_items("t1", "a")))
    await _settle()
    later = [
        asyncio.ensure_future(batcher.append(_items(t, c)))
        for t, c in [("t1", "b"), ("t2", "c"), ("t1", "d")]
    ]
    await _settle()
    assert db.batches == [["a"]]  # the first went alone, at once
    await db.release(0)
    await db.release(1)
    assert [m.content for m in await first] == ["a"]
    assert [(await f)[0].content for f in later] == ["b", "c", "d"]
    assert db.batches == [["a"], ["b", "c", "d"]]


async def test_a_trace_in_flight_waits_while_other_traces_get_their_own_batch():
    db = FakeDb()
    batcher = _batcher(db, max_flushes=2)
    a = asyncio.ensure_future(batcher.append(_items("t1", "a")))
    await _settle()
    b = asyncio.ensure_future(batcher.append(_items("t1", "b")))  # t1 is held: no second batch for it
    c = asyncio.ensure_future(batcher.append(_items("t2", "c")))
    await _settle()
    assert db.batches == [["a"], ["c"]]
    await db.release(1)
    await c
    await _settle()
    assert not b.done() and db.batches == [["a"], ["c"]]
    await db.release(0)
    await db.release(2)
    await asyncio.gather(a, b)
    assert db.batches == [["a"], ["c"], ["b"]]


async def test_batches_are_bounded_and_groups_never_split():
    db = FakeDb()
    batcher = _batcher(db, max_flushes=1, max_batch=3)
    blocker = asyncio.ensure_future(batcher.append(_items("t0", "x")))
    await _settle()
    waiting = [
        asyncio.ensure_future(batcher.append(_items("t1", "a1", "a2"))),  # a turn: two messages
        asyncio.ensure_future(batcher.append(_items("t2", "b1", "b2"))),
        asyncio.ensure_future(batcher.append(_items("t1", "c"))),  # after t1's turn, so after t2's too
        asyncio.ensure_future(batcher.append(_items("t3", "d"))),
    ]
    await _settle()
    for n in range(3):
        await db.release(n)
    await asyncio.gather(blocker, *waiting)
    assert db.batches == [["x"], ["a1", "a2", "b1", "b2"], ["c", "d"]]


async def test_a_caller_that_gives_up_before_its_batch_is_not_written():
    db = FakeDb()
    batcher = _batcher(db, max_flushes=1)
    first = asyncio.ensure_future(batcher.append(_items("t1", "a")))
    await _settle()
    gone = asyncio.ensure_future(batcher.append(_items("t1", "b1", "b2")))
    kept = asyncio.ensure_future(batcher.append(_items("t1", "c")))
    await _settle()
    gone.cancel()
    await db.release(0)
    await db.release(1)
    await asyncio.gather(first, kept)
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert db.batches == [["a"], ["c"]]


async def test_a_failing_batch_fails_only_the_group_that_broke_it():
    db = FakeDb()
    db.fail_on = {"bad"}
    batcher = _batcher(db, max_flushes=1)
    first = asyncio.ensure_future(batcher.append(_items("t1", "a")))
    await _settle()
    good = asyncio.ensure_future(batcher.append(_items("t1", "g1", "g2")))
    bad = asyncio.ensure_future(batcher.append(_items("t2", "x", "bad")))
    other = asyncio.ensure_future(batcher.append(_items("t3", "o")))
    await _settle()
    for n in range(5):  # the batch, then each group on its own
        await db.release(n)
    await first
    assert [m.content for m in await good] == ["g1", "g2"]
    assert [m.content for m in await other] == ["o"]
    with pytest.raises(RuntimeError, match="refused"):
        await bad
    assert db.batches == [["a"], ["g1", "g2", "x", "bad", "o"], ["g1", "g2"], ["x", "bad"], ["o"]]
