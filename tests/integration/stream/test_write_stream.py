"""WriteStream, a writer's long-lived append call for one key, over real gRPC on the memory and Redis
backends: each batch is answered with its offsets in order, the errors are AppendEvents' own, ending the
call, and a service that stops between batches answers SHUTDOWN without taking another batch; a batch
awaiting its turn's start. (Many writers on one call, and EventSink over them: test_writes.py.
Unauthenticated and forged calls: test_identity.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.errors import Shutdown, from_rpc_error
from agentmesh.stream.v1 import stream_service_pb2 as pb
from tests.integration.stream.conftest import (
    StreamFactory,
    StreamHarness,
    as_int,
    close,
    collect,
    create,
    info,
)
from tests.mesh import wait_until


class Writer:
    """One WriteStream call driven batch by batch: `send` a batch, get its offsets (or the call's error)."""

    def __init__(self, h: StreamHarness, user: str = "") -> None:
        self.requests: asyncio.Queue[pb.WriteStreamRequest | None] = asyncio.Queue()
        with identity.acting_as(user):
            self.call = h.stub.WriteStream(self._feed())

    async def _feed(self) -> AsyncIterator[pb.WriteStreamRequest]:
        while (request := await self.requests.get()) is not None:
            yield request

    async def send(self, key: str, *texts: str) -> list[str]:
        batch = [events.reasoning_delta(t) for t in texts]  # readers merge text deltas, not these
        self.requests.put_nowait(pb.WriteStreamRequest(key=key, events=batch))
        try:
            resp = await self.call.read()
        except grpc.aio.AioRpcError:
            self.requests.put_nowait(None)  # the call's request reader ends too
            raise
        assert resp is not grpc.aio.EOF
        return list(resp.offsets)

    def defer(self, key: str, *texts: str) -> None:
        """Sends a batch that asks for no answer (its offsets come with the next answer)."""
        batch = [events.reasoning_delta(t) for t in texts]
        self.requests.put_nowait(pb.WriteStreamRequest(key=key, events=batch, defer_answer=True))

    async def end(self) -> grpc.StatusCode:
        self.requests.put_nowait(None)
        return await self.call.code()


def texts(got: list[ev.Event]) -> list[str]:
    return [e.reasoning_delta.reasoning_delta for e in got if events.kind(e) == "reasoning_delta"]


SERVICE = "agentmesh.stream.v1.StreamService"


def started(h: StreamHarness, method: str, kind: str) -> float:
    """RPCs of `method` the server started (its own Prometheus registry)."""
    labels = {"grpc_service": SERVICE, "grpc_method": method, "grpc_type": kind}
    return h.server.registry.get_sample_value("agentmesh_grpc_server_started_total", labels) or 0.0


@pytest.mark.parametrize("user", ["alice", ""], ids=["owner", "mesh"])
async def test_batches_are_answered_with_their_offsets_in_order(
    stream: StreamHarness, unique: str, user: str
) -> None:
    key = f"trace:{unique}"
    await create(stream, key, owner="alice")
    writer = Writer(stream, user)
    answered = [
        await writer.send(key, "a"),
        await writer.send(key, "b", "c", "d"),
        await writer.send(key, "e"),
    ]
    assert [len(o) for o in answered] == [1, 3, 1]
    offsets = [o for batch in answered for o in batch]
    assert [as_int(o) for o in offsets] == sorted({as_int(o) for o in offsets})  # strictly increasing
    assert await writer.end() == grpc.StatusCode.OK
    assert (await info(stream, key)).last_offset == offsets[-1]
    closed = await close(stream, key)
    got = await collect(stream, key, reader="alice")
    assert [e.offset for e in got] == [*offsets, closed.offset]
    assert "".join(texts(got)) == "abcde"


async def test_deferred_batches_are_answered_with_the_next_answer(stream: StreamHarness, unique: str) -> None:
    """Batches sent with defer_answer get no answer of their own: the next batch that asks is answered
    with their offsets first, then its own, in order; an empty batch may ask."""
    key = f"trace:{unique}"
    await create(stream, key)
    writer = Writer(stream)
    writer.defer(key, "a")
    writer.defer(key, "b", "c")
    answered = await writer.send(key, "d")
    assert len(answered) == 4
    writer.defer(key, "e")
    assert len(await writer.send(key)) == 1  # an empty batch asks for the deferred one's offset
    assert await writer.end() == grpc.StatusCode.OK
    await close(stream, key)
    got = await collect(stream, key)
    assert texts(got) == ["a", "b", "c", "d", "e"]
    assert [e.offset for e in got[:4]] == answered
    assert [as_int(o) for o in answered] == sorted({as_int(o) for o in answered})


async def test_a_deferred_batch_that_fails_ends_the_call_with_its_status(
    stream: StreamHarness, unique: str
) -> None:
    """A writer that asked for no answer still learns of the failure: the call ends with it."""
    key = f"trace:{unique}"
    await create(stream, key)
    writer = Writer(stream)
    writer.defer(key, "kept")
    await wait_until(lambda: _length(stream, key, 1), what="the deferred batch stored")
    await close(stream, key)
    writer.defer(key, "refused")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(writer.call.read(), 10)  # no answer came: the call's end
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    writer.requests.put_nowait(None)
    assert texts(await collect(stream, key)) == ["kept"]


async def _length(h: StreamHarness, key: str, n: int) -> bool:
    return (await info(h, key)).length == n


async def test_a_stop_answers_the_deferred_batches_it_took_before_shutdown(
    stream_factory: StreamFactory, unique: str
) -> None:
    """A stopping service answers every deferred batch it took, then says SHUTDOWN: the writer knows
    what was stored, and that nothing after it was."""
    h = await stream_factory()
    key = f"trace:{unique}"
    await create(h, key)
    writer = Writer(h)
    writer.defer(key, "a")
    writer.defer(key, "b", "c")
    await wait_until(lambda: _length(h, key, 3), what="the deferred batches stored")
    await asyncio.wait_for(h.server.stop(30.0), 5)
    last = await asyncio.wait_for(writer.call.read(), 10)
    assert last is not grpc.aio.EOF and len(last.offsets) == 3
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await writer.call.read()
    assert isinstance(from_rpc_error(err.value), Shutdown), err.value
    writer.requests.put_nowait(None)
    assert (await h.backend.info(key)).last_offset == last.offsets[-1]


async def test_a_buffer_closed_mid_stream_ends_the_call_failed_precondition(
    stream: StreamHarness, unique: str
) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    writer = Writer(stream)
    first = await writer.send(key, "kept")
    await close(stream, key)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await writer.send(key, "refused")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"stream {key} is closed" in (err.value.details() or "")
    got = await collect(stream, key)
    assert got[0].offset == first[0] and texts(got) == ["kept"] and events.kind(got[-1]) == "done"


@pytest.mark.parametrize(
    ("case", "code", "details"),
    [
        ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "invalid stream key"),
        ("unknown", grpc.StatusCode.NOT_FOUND, "no stream buffer"),
        ("foreign", grpc.StatusCode.NOT_FOUND, "no stream buffer"),
        ("second-key", grpc.StatusCode.INVALID_ARGUMENT, "one WriteStream call writes one key"),
    ],
)
async def test_a_bad_key_ends_the_call_with_a_clear_status(
    stream: StreamHarness, unique: str, case: str, code: grpc.StatusCode, details: str
) -> None:
    mine, other = f"trace:{unique}", f"a2a:{unique}"
    await create(stream, mine, owner="alice")
    await create(stream, other, owner="alice")
    writer = Writer(stream, "bob" if case == "foreign" else "alice")
    target = {"invalid": "nonsense", "unknown": f"subagent:{unique}", "foreign": mine, "second-key": other}
    if case == "second-key":
        await writer.send(mine, "first")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await writer.send(target[case], "x")
    assert err.value.code() == code
    assert details in (err.value.details() or ""), err.value.details()
    assert (await info(stream, other)).length == 0  # nothing reached another buffer
    assert (await info(stream, mine)).length == (1 if case == "second-key" else 0)


async def test_a_stop_between_batches_answers_shutdown_promptly(
    stream_factory: StreamFactory, unique: str
) -> None:
    h = await stream_factory()
    key = f"trace:{unique}"
    await create(h, key)
    writer = Writer(h)
    await writer.send(key, "before")
    started = time.monotonic()
    await asyncio.wait_for(h.server.stop(30.0), 5)  # the open write call does not hold up the drain
    assert time.monotonic() - started < 5
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await writer.send(key, "after")
    assert isinstance(from_rpc_error(err.value), Shutdown), err.value
    assert (await h.backend.info(key)).length == 1  # the unanswered batch was not taken
