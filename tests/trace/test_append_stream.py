"""AppendMessageStream (libs.clients.MessageAppender): appends on one long-lived stream, answered in
order, each failed append answered with its own error while the stream goes on, the caller taken from
the stream's verified identity, and the same gap-free order as unary appends under concurrency."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text

from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from libs import identity
from libs.clients import MessageAppender
from libs.errors import DeadlineExceeded, InvalidArgument, NotFound, Unauthenticated, Unavailable
from libs.identity import Signer
from libs.rpc import channel
from services.trace.server import build
from tests.trace.conftest import new_trace

USER = tp.MESSAGE_ROLE_USER


def _msg(trace_id: str, content: str, **kw) -> tp.Message:
    return tp.Message(trace_id=trace_id, role=USER, content=content, **kw)


async def _main_path(stub, owner: str, trace_id: str) -> list[tp.Message]:
    with identity.acting_as(owner):
        resp = await stub.ListMessages(
            ts.ListMessagesRequest(trace_id=trace_id, mode=ts.PATH_MODE_MAIN_PATH, limit=1000)
        )
    return list(resp.messages)


async def test_appends_on_one_stream_are_stored_in_order(trace_stub, unique):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    appender = MessageAppender(trace_stub)
    with identity.acting_as(owner):
        stored = [await appender.append(_msg(s.id, f"m{i}")) for i in range(20)]
    await appender.aclose()
    assert [m.sequence for m in stored] == list(range(1, 21))
    assert [m.parent_sequence for m in stored] == list(range(0, 20))
    assert all(m.id and m.create_time.seconds for m in stored)
    path = await _main_path(trace_stub, owner, s.id)
    assert [m.content for m in path] == [f"m{i}" for i in range(20)]


async def test_a_failed_append_fails_alone_and_the_stream_goes_on(trace_stub, unique):
    owner, other = f"u-{unique}", f"o-{unique}"
    mine = await new_trace(trace_stub, owner)
    theirs = await new_trace(trace_stub, other)
    appender = MessageAppender(trace_stub)
    with identity.acting_as(owner):
        first = await appender.append(_msg(mine.id, "one"))
        with pytest.raises(NotFound):  # another user's trace reads as missing
            await appender.append(_msg(theirs.id, "intruder"))
        with pytest.raises(NotFound):
            await appender.append(_msg("no-such-trace", "x"))
        with pytest.raises(InvalidArgument, match="parent_sequence 7"):
            await appender.append(_msg(mine.id, "x"), parent_sequence=7)
        with pytest.raises(InvalidArgument):
            await appender.append(tp.Message(role=USER, content="no trace id"))
        second = await appender.append(_msg(mine.id, "two"))
    await appender.aclose()
    assert (first.sequence, second.sequence, second.parent_sequence) == (1, 2, 1)
    assert await _main_path(trace_stub, other, theirs.id) == []


async def test_the_caller_is_the_streams_identity(trace_stub, trace_server, unique):
    """Without a user's identity the stream is refused; a stream opened as one user appends as that
    user only (a field of the message names no one)."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    appender = MessageAppender(trace_stub)
    with pytest.raises(Unauthenticated):
        await appender.append(_msg(s.id, "nobody"))  # the mesh's own principal is no user
    unsigned = channel(trace_server.target, Signer(b"not the mesh secret"))
    try:
        from agentmesh.trace.v1 import trace_service_pb2_grpc

        forged = MessageAppender(trace_service_pb2_grpc.TraceServiceStub(unsigned))
        with identity.acting_as(owner), pytest.raises(Unauthenticated):
            await forged.append(_msg(s.id, "forged"))
    finally:
        await unsigned.close()
    stranger = MessageAppender(trace_stub)
    with identity.acting_as(f"x-{unique}"), pytest.raises(NotFound):
        await stranger.append(_msg(s.id, "stranger"))
    await stranger.aclose()
    assert await _main_path(trace_stub, owner, s.id) == []


async def test_fifty_streams_on_one_trace_stay_gap_free(trace_stub, unique):
    """50 writers, each on its own stream, 4 appends each on one trace: 200 distinct sequences 1..200,
    one chain, and each writer's own appends in the order it sent them."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)

    async def writer(w: int) -> list[tp.Message]:
        appender = MessageAppender(trace_stub)
        try:
            with identity.acting_as(owner):
                return [await appender.append(_msg(s.id, f"w{w}-{i}")) for i in range(4)]
        finally:
            await appender.aclose()

    results = await asyncio.gather(*(writer(w) for w in range(50)))
    sequences = sorted(m.sequence for ms in results for m in ms)
    assert sequences == list(range(1, 201))
    for ms in results:
        assert [m.sequence for m in ms] == sorted(m.sequence for m in ms)
    path = await _main_path(trace_stub, owner, s.id)
    assert [m.sequence for m in path] == list(range(1, 201))


async def test_an_append_without_an_answer_fails_by_its_deadline(trace_stub, trace_engine, unique):
    """Another writer holds the trace's row (a transaction that updated it): the append gets no
    answer, fails with DeadlineExceeded after its deadline instead of hanging, and once the row is
    free the next append (on a new stream) is stored after the head."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    appender = MessageAppender(trace_stub, timeout_s=1.0)
    with identity.acting_as(owner):
        await appender.append(_msg(s.id, "before"))
        async with trace_engine.connect() as conn:
            await conn.execute(text("UPDATE sessions SET title = title WHERE id = :id"), {"id": s.id})
            with pytest.raises(DeadlineExceeded, match="within 1 s"):
                await asyncio.wait_for(appender.append(_msg(s.id, "held")), 15)
            await conn.rollback()
        after = await appender.append(_msg(s.id, "after"))
    await appender.aclose()
    path = await _main_path(trace_stub, owner, s.id)
    assert path[-1].sequence == after.sequence and path[-1].content == "after"
    assert path[0].content == "before"


async def test_a_stopped_service_ends_the_append_unavailable(trace_backend, signer, unique):
    """The service goes away under an open stream: the next append fails Unavailable (never hangs),
    and the appender does not keep the dead stream."""
    from agentmesh.trace.v1 import trace_service_pb2_grpc

    server = await build(trace_backend.settings, "127.0.0.1:0")
    ch = channel(server.target, signer)
    try:
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        owner = f"u-{unique}"
        s = await new_trace(stub, owner)
        appender = MessageAppender(stub, timeout_s=5.0)
        with identity.acting_as(owner):
            await appender.append(_msg(s.id, "before"))
            await server.stop(0)
            with pytest.raises(Unavailable):
                await asyncio.wait_for(appender.append(_msg(s.id, "lost")), 15)
        assert appender._call is None  # the next append opens a new stream
    finally:
        await ch.close()
        await server.stop(0)
