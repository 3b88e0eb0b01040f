"""AppendMessageStream (libs.clients.MessageAppender): appends on one long-lived stream, answered in
order, each failed append answered with its own error while the stream goes on, the caller taken from
the stream's verified identity (or an append's own verified token), and the same gap-free order as
unary appends under concurrency, also for many writers of different users sharing one stream."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from agentmesh.libs import identity
from agentmesh.libs.clients import AskCall, MessageAppender
from agentmesh.libs.errors import DeadlineExceeded, InvalidArgument, NotFound, Unauthenticated, Unavailable
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import channel
from agentmesh.services.trace.server import build
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.conftest import TEST_SECRET
from tests.integration.trace.conftest import new_trace

USER = tp.MESSAGE_ROLE_USER


def _msg(trace_id: str, content: str, **kw) -> tp.Message:
    return tp.Message(trace_id=trace_id, role=USER, content=content, **kw)


async def _main_path(stub, owner: str, trace_id: str) -> list[tp.Message]:
    with identity.acting_as(owner):
        resp = await stub.ListMessages(
            ms.ListMessagesRequest(trace_id=trace_id, mode=ms.PATH_MODE_MAIN_PATH, limit=1000)
        )
    return list(resp.messages)


async def test_appends_on_one_stream_are_stored_in_order(trace_stub, unique, message_stub):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    appender = MessageAppender(message_stub)
    with identity.acting_as(owner):
        stored = [await appender.append(_msg(s.id, f"m{i}")) for i in range(20)]
    await appender.aclose()
    assert [m.sequence for m in stored] == list(range(1, 21))
    assert [m.parent_sequence for m in stored] == list(range(0, 20))
    assert all(m.id and m.create_time.seconds for m in stored)
    path = await _main_path(message_stub, owner, s.id)
    assert [m.content for m in path] == [f"m{i}" for i in range(20)]


async def test_a_failed_append_fails_alone_and_the_stream_goes_on(trace_stub, unique, message_stub):
    owner, other = f"u-{unique}", f"o-{unique}"
    mine = await new_trace(trace_stub, owner)
    theirs = await new_trace(trace_stub, other)
    appender = MessageAppender(message_stub)
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
    assert await _main_path(message_stub, other, theirs.id) == []


async def test_the_caller_is_the_streams_identity(trace_stub, trace_server, unique, message_stub):
    """Without a user's identity the stream is refused; a stream opened as one user appends as that
    user only (a field of the message names no one)."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    appender = MessageAppender(message_stub)
    with pytest.raises(Unauthenticated):
        await appender.append(_msg(s.id, "nobody"))  # the mesh's own principal is no user
    unsigned = channel(trace_server.target, Signer(b"not the mesh secret"))
    try:
        from agentmesh.trace.v1 import message_service_pb2_grpc

        forged = MessageAppender(message_service_pb2_grpc.MessageServiceStub(unsigned))
        # Refused at once: UNAUTHENTICATED, or unavailable when the appender's first write races the
        # refusal (grpc.aio then reports its own send error, libs.errors.LOST_SEND, instead of the
        # server's status; seen in about one run of ten). Nothing is stored either way (checked below).
        with identity.acting_as(owner), pytest.raises((Unauthenticated, Unavailable)):
            await forged.append(_msg(s.id, "forged"))
    finally:
        await unsigned.close()
    stranger = MessageAppender(message_stub)
    with identity.acting_as(f"x-{unique}"), pytest.raises(NotFound):
        await stranger.append(_msg(s.id, "stranger"))
    await stranger.aclose()
    assert await _main_path(message_stub, owner, s.id) == []


async def test_fifty_streams_on_one_trace_stay_gap_free(trace_stub, unique, message_stub):
    """50 writers, each on its own stream, 4 appends each on one trace: 200 distinct sequences 1..200,
    one chain, and each writer's own appends in the order it sent them."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)

    async def writer(w: int) -> list[tp.Message]:
        appender = MessageAppender(message_stub)
        try:
            with identity.acting_as(owner):
                return [await appender.append(_msg(s.id, f"w{w}-{i}")) for i in range(4)]
        finally:
            await appender.aclose()

    results = await asyncio.gather(*(writer(w) for w in range(50)))
    sequences = sorted(m.sequence for got in results for m in got)
    assert sequences == list(range(1, 201))
    for got in results:
        assert [m.sequence for m in got] == sorted(m.sequence for m in got)
    path = await _main_path(message_stub, owner, s.id)
    assert [m.sequence for m in path] == list(range(1, 201))


async def test_an_append_without_an_answer_fails_by_its_deadline(
    trace_stub, trace_engine, unique, message_stub
):
    """Another writer holds the trace's row (a transaction that updated it): the append gets no
    answer, fails with DeadlineExceeded after its deadline instead of hanging, and once the row is
    free the next append (on a new stream) is stored after the head."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    appender = MessageAppender(message_stub, timeout_s=1.0)
    with identity.acting_as(owner):
        await appender.append(_msg(s.id, "before"))
        async with trace_engine.connect() as conn:
            await conn.execute(text("UPDATE traces SET title = title WHERE id = :id"), {"id": s.id})
            with pytest.raises(DeadlineExceeded, match="within 1 s"):
                await asyncio.wait_for(appender.append(_msg(s.id, "held")), 15)
            await conn.rollback()
        after = await appender.append(_msg(s.id, "after"))
    await appender.aclose()
    path = await _main_path(message_stub, owner, s.id)
    assert path[-1].sequence == after.sequence and path[-1].content == "after"
    assert path[0].content == "before"


async def test_a_stopped_service_ends_the_append_unavailable(trace_backend, signer, unique):
    """The service goes away under an open stream: the next append fails Unavailable (never hangs),
    and the appender does not keep the dead stream."""
    from agentmesh.trace.v1 import message_service_pb2_grpc, trace_service_pb2_grpc

    server = await build(trace_backend.settings, "127.0.0.1:0")
    ch = channel(server.target, signer)
    try:
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        owner = f"u-{unique}"
        s = await new_trace(stub, owner)
        appender = MessageAppender(message_service_pb2_grpc.MessageServiceStub(ch), timeout_s=5.0)
        with identity.acting_as(owner):
            await appender.append(_msg(s.id, "before"))
            await server.stop(0)
            with pytest.raises(Unavailable):
                await asyncio.wait_for(appender.append(_msg(s.id, "lost")), 15)
        assert all(lane.call is None for lane in appender._lanes)  # the next append opens a new stream
    finally:
        await ch.close()
        await server.stop(0)


async def test_writers_of_many_users_share_one_stream(trace_stub, signer, unique, message_stub):
    """One appender with a signer, 40 concurrent writers of 5 users (8 writers per user, one trace
    each), 10 appends each: on its two streams (lanes) and no more; every trace gap-free 1..80 in one
    chain, each writer's appends in its order, every row in its writer's user's trace (another user's
    writer gets NotFound)."""
    users = [f"u{k}-{unique}" for k in range(5)]
    traces = {u: (await new_trace(trace_stub, u)).id for u in users}
    appender = MessageAppender(message_stub, signer=signer)
    streams: set[int] = set()

    async def writer(w: int) -> list[tp.Message]:
        user = users[w % 5]
        out = []
        with identity.acting_as(user):
            for i in range(10):
                out.append(await appender.append(_msg(traces[user], f"w{w}-{i}")))
                streams.update(id(lane.call) for lane in appender._lanes if lane.call is not None)
        return out

    async def intruder() -> None:
        with identity.acting_as(users[1]), pytest.raises(NotFound):
            await appender.append(_msg(traces[users[0]], "not mine"))

    results, _ = await asyncio.gather(asyncio.gather(*(writer(w) for w in range(40))), intruder())
    await appender.aclose()
    assert len(streams) == 2
    for w, got in enumerate(results):
        assert {m.trace_id for m in got} == {traces[users[w % 5]]}
        assert [m.content for m in got] == [f"w{w}-{i}" for i in range(10)]
        assert [m.sequence for m in got] == sorted(m.sequence for m in got)
    for k, user in enumerate(users):
        path = await _main_path(message_stub, user, traces[user])
        assert [m.sequence for m in path] == list(range(1, 81))
        assert [m.parent_sequence for m in path] == list(range(0, 80))
        assert {m.content.split("-")[0] for m in path} == {f"w{w}" for w in range(k, 40, 5)}


async def test_the_mesh_has_no_user_to_append_as(trace_stub, signer, unique, message_stub):
    """A shared appender (its stream opened as the mesh) sends an append made outside any user's work
    without a token: the mesh's own principal appends nothing."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    appender = MessageAppender(message_stub, signer=signer)
    with pytest.raises(Unauthenticated):
        await appender.append(_msg(s.id, "nobody"))
    with identity.acting_as(owner):
        stored = await appender.append(_msg(s.id, "mine"))
    await appender.aclose()
    assert stored.sequence == 1


def _item(trace_id: str, content: str, token: str) -> ms.StreamAppend:
    return ms.StreamAppend(append=ms.MessageAppend(message=_msg(trace_id, content)), identity=token)


async def test_a_bad_token_fails_only_its_own_append(trace_stub, signer, unique, message_stub):
    """A request of several appends, each with its own token: a forged, an expired, a malformed one and
    a valid token of a user naming another user's trace fail alone; the rest are stored in order."""
    owner, other = f"u-{unique}", f"o-{unique}"
    s = await new_trace(trace_stub, owner)
    forged = Signer(b"not the mesh secret, forged").mint(owner)
    expired = Signer(TEST_SECRET.encode(), clock=lambda: time.time() - 3600).mint(owner)
    request = ms.AppendMessageStreamRequest(
        appends=[
            _item(s.id, "one", signer.mint(owner)),
            _item(s.id, "forged", forged),
            _item(s.id, "expired", expired),
            _item(s.id, "malformed", "v1.nonsense"),
            _item(s.id, "stranger", signer.mint(other)),
            _item(s.id, "caller", ""),  # the stream's caller: the mesh, no user
            _item(s.id, "two", signer.mint(owner)),
        ]
    )
    with identity.acting_as(""):
        call = AskCall(message_stub.AppendMessageStream)
    try:
        resp = await call.ask(request)
        again = await call.ask(
            ms.AppendMessageStreamRequest(appends=[_item(s.id, "three", signer.mint(owner))])
        )
    finally:
        await call.end(5)
    reasons = [r.error_reason for r in resp.results]
    assert reasons == [
        "",
        "UNAUTHENTICATED",
        "UNAUTHENTICATED",
        "UNAUTHENTICATED",
        "NOT_FOUND",
        "UNAUTHENTICATED",
        "",
    ]
    assert "expired" in resp.results[2].error_message
    assert [resp.results[0].message.sequence, resp.results[6].message.sequence] == [1, 2]
    assert again.results[0].message.sequence == 3  # the stream went on
    path = await _main_path(message_stub, owner, s.id)
    assert [m.content for m in path] == ["one", "two", "three"]


async def test_a_request_holds_at_most_500_appends(trace_stub, signer, unique, message_stub):
    """500 appends in one request are stored in order; 501 end the stream INVALID_ARGUMENT, unstored."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    token = signer.mint(owner)
    with identity.acting_as(owner):
        call = AskCall(message_stub.AppendMessageStream)
    try:
        resp = await call.ask(
            ms.AppendMessageStreamRequest(appends=[_item(s.id, f"m{i}", token) for i in range(500)])
        )
        assert [r.message.sequence for r in resp.results] == list(range(1, 501))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call.ask(ms.AppendMessageStreamRequest(appends=[_item(s.id, "x", "") for _ in range(501)]))
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 500" in (failed.value.details() or "")
    finally:
        call.cancel()
    path = await _main_path(message_stub, owner, s.id)
    assert len(path) == 500 and path[-1].content == "m499"


async def test_a_request_carries_one_append_or_several_not_both(trace_stub, signer, unique, message_stub):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    both = ms.AppendMessageStreamRequest(
        append=ms.MessageAppend(message=_msg(s.id, "one")),
        appends=[_item(s.id, "two", signer.mint(owner))],
    )
    with identity.acting_as(owner):
        call = AskCall(message_stub.AppendMessageStream)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call.ask(both)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        call.cancel()
    assert await _main_path(message_stub, owner, s.id) == []


async def test_copies_of_every_user_of_a_request_are_found_in_one_read(
    trace_stub, trace_engine, signer, unique, message_stub
):
    """A request of three users' appends, one naming its user's cached copy of a peer's trace by the
    copy's local id: that one is refused (FAILED_PRECONDITION naming the home), another user naming the
    same id finds nothing (NOT_FOUND), the rest are stored; the copies of all three users are looked up
    in one statement (one per user made a batch of many users a database round trip each)."""
    a, b, c = (f"{k}-{unique}" for k in "abc")
    mine = {u: (await new_trace(trace_stub, u)).id for u in (a, b, c)}
    copy = (await new_trace(trace_stub, a)).id
    async with trace_engine.begin() as conn:
        await conn.execute(
            text("UPDATE traces SET home = :home WHERE id = :id"), {"home": f"@orgb/{unique}", "id": copy}
        )
    lookups: list[str] = []

    def seen(conn, cursor, statement: str, *args) -> None:
        if "home IS NOT NULL" in statement and "traces.id IN" in statement:
            lookups.append(statement)

    request = ms.AppendMessageStreamRequest(
        appends=[
            _item(mine[a], "a", signer.mint(a)),
            _item(mine[b], "b", signer.mint(b)),
            _item(copy, "into the copy", signer.mint(a)),
            _item(copy, "a stranger", signer.mint(c)),
            _item(mine[c], "c", signer.mint(c)),
        ]
    )
    with identity.acting_as(""):
        call = AskCall(message_stub.AppendMessageStream)
    event.listen(Engine, "before_cursor_execute", seen)
    try:
        resp = await call.ask(request)
    finally:
        event.remove(Engine, "before_cursor_execute", seen)
        await call.end(5)
    assert [r.error_reason for r in resp.results] == ["", "", "FAILED_PRECONDITION", "NOT_FOUND", ""]
    assert f"@orgb/{unique}" in resp.results[2].error_message
    assert [resp.results[i].message.content for i in (0, 1, 4)] == ["a", "b", "c"]
    assert len(lookups) == 1, lookups
