"""WriteStream, a writer's long-lived append call for one key, over real gRPC on the memory and Redis
backends: each batch is answered with its offsets in order, the errors are AppendEvents' own, ending the
call, and a service that stops between batches answers SHUTDOWN without taking another batch; a batch
awaiting its turn's start. (Many writers on one call, and EventSink over them: test_writes.py.
Unauthenticated and forged calls: test_identity.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.errors import Shutdown, from_rpc_error
from agentmesh.services.stream import backend as stream_backend
from agentmesh.stream.v1 import stream_service_pb2 as pb
from tests.integration.stream.conftest import (
    StreamFactory,
    StreamHarness,
    append,
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


def _start(unique: str) -> ev.Event:
    return ev.Event(start=ev.TurnStart(session_id=unique, assistant_message_id=7))


async def _held(h: StreamHarness, writer: Writer, key: str, *texts: str) -> asyncio.Future[Any]:
    """Sends a batch with await_start; returns its answer to come, once the service holds it."""
    held = pb.WriteStreamRequest(key=key, events=[events.reasoning_delta(t) for t in texts], await_start=True)
    writer.requests.put_nowait(held)
    answer = asyncio.ensure_future(writer.call.read())
    await wait_until(lambda: h.backend.subscribers == 1, what="the service holds the batch")
    assert not answer.done() and (await info(h, key)).length == 0  # held: nothing appended yet
    return answer


async def test_a_batch_awaiting_start_goes_right_after_the_turns_start(
    stream: StreamHarness, unique: str
) -> None:
    """WriteStreamRequest.await_start (a run started before its turn was stored): the batch waits for
    the turn's `start`, is appended right after it, and its answer carries that `start`; an empty
    batch only waits."""
    key = f"trace:{unique}"
    await create(stream, key)
    writer = Writer(stream)
    answer = await _held(stream, writer, key, "early", "bird")
    await append(stream, key, [_start(unique)])
    resp = await asyncio.wait_for(answer, 10)
    assert resp.start.assistant_message_id == 7 and len(resp.offsets) == 2
    # Once started, await_start on an empty batch answers at once (nothing appended).
    writer.requests.put_nowait(pb.WriteStreamRequest(key=key, await_start=True))
    again = await asyncio.wait_for(writer.call.read(), 10)
    assert again.start.assistant_message_id == 7 and list(again.offsets) == []
    assert await writer.end() == grpc.StatusCode.OK
    await close(stream, key)
    got = await collect(stream, key)
    assert [events.kind(e) for e in got] == ["start", "reasoning_delta", "reasoning_delta", "done"]
    assert [e.offset for e in got[1:3]] == list(resp.offsets)


async def test_a_batch_awaiting_start_waits_for_its_buffer_to_be_created(
    stream: StreamHarness, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started beside its buffer's CreateStream: its first batch finds no buffer yet; the service
    waits for the buffer to be created, then for the turn's `start`, and appends the batch after it."""
    looked = asyncio.Event()
    waits = stream_backend._create_waits

    def counted() -> Iterator[float | None]:
        for i, pause in enumerate(waits()):
            if i == 1:
                looked.set()  # one look found no buffer
            yield pause

    monkeypatch.setattr(stream_backend, "_create_waits", counted)
    key = f"trace:{unique}"
    writer = Writer(stream)
    writer.requests.put_nowait(
        pb.WriteStreamRequest(key=key, events=[events.reasoning_delta("before")], await_start=True)
    )
    answer = asyncio.ensure_future(writer.call.read())
    await asyncio.wait_for(looked.wait(), 10)
    await create(stream, key)
    await append(stream, key, [_start(unique)])
    resp = await asyncio.wait_for(answer, 10)
    assert resp.start.assistant_message_id == 7 and len(resp.offsets) == 1
    assert await writer.end() == grpc.StatusCode.OK
    await close(stream, key)
    assert [events.kind(e) for e in await collect(stream, key)] == ["start", "reasoning_delta", "done"]


async def test_a_batch_awaiting_start_of_a_buffer_never_created_is_not_found(
    stream: StreamHarness, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No buffer comes within CREATE_WAIT_S: NOT_FOUND, nothing stored."""
    monkeypatch.setattr(stream_backend, "CREATE_WAIT_S", 0.2)
    key = f"trace:{unique}"
    writer = Writer(stream)
    writer.requests.put_nowait(
        pb.WriteStreamRequest(key=key, events=[events.reasoning_delta("x")], await_start=True)
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(writer.call.read(), 10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value
    writer.requests.put_nowait(None)
    assert not (await info(stream, key)).exists


@pytest.mark.parametrize(
    ("first", "code"),
    [("closed", grpc.StatusCode.CANCELLED), ("other", grpc.StatusCode.FAILED_PRECONDITION)],
)
async def test_a_batch_awaiting_start_is_refused_when_the_buffer_shows_anything_else_first(
    stream: StreamHarness, unique: str, first: str, code: grpc.StatusCode
) -> None:
    """The turn failed to begin (its buffer closed) or someone else wrote first: the held batch is
    never appended and the call ends with a clear status."""
    key = f"trace:{unique}"
    await create(stream, key)
    writer = Writer(stream)
    answer = await _held(stream, writer, key, "never")
    if first == "closed":
        await close(stream, key)
    else:
        await append(stream, key, [events.reasoning_delta("someone else")])
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await asyncio.wait_for(answer, 10)
    assert err.value.code() == code, err.value
    writer.requests.put_nowait(None)
    assert "never" not in texts(await collect(stream, key, idle_timeout_ms=200))
