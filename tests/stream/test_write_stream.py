"""WriteStream, a writer's long-lived append call, over real gRPC on the memory and Redis backends: each
batch is answered with its offsets in order, the errors are AppendEvents' own, ending the call, and a
service that stops between batches answers SHUTDOWN without taking another batch. Then EventSink (the
runtime's writer) over it: one call per sink, a buffer closed under it cancels the run, and a drained
replica's writer carries on through another one. (Unauthenticated and forged calls: test_identity.py.
The stream service SIGKILLed mid-turn: tests/cli/test_faults.py.)"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.stream.v1 import stream_service_pb2 as pb
from libs import events, identity
from libs.clients import Clients
from libs.errors import Cancelled, Shutdown, from_rpc_error
from services.agent_runtime.sink import EventSink
from services.stream import backend as stream_backend
from services.stream.redis_backend import RedisBackend
from services.stream.server import build
from tests.conftest import service_settings
from tests.mesh import wait_until
from tests.stream.conftest import (
    StreamFactory,
    StreamHarness,
    append,
    as_int,
    close,
    collect,
    create,
    info,
)


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
    key = f"session:{unique}"
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
    key = f"session:{unique}"
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
    key = f"session:{unique}"
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
    key = f"session:{unique}"
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
    key = f"session:{unique}"
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
    mine, other = f"session:{unique}", f"a2a:{unique}"
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
    key = f"session:{unique}"
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


def clients_for(h: StreamHarness, signer: Any, target: str = "") -> Clients:
    settings = h.settings.model_copy(deep=True)
    settings.addresses.stream = target or h.server.target
    return Clients(settings, signer)


def count_answers(clients: Clients) -> list[int]:
    """Counts the answers read off the WriteStream calls of `clients` (the real calls, read through)."""
    counted = [0]
    write = clients.stream.WriteStream

    def counting(requests: Any, **kw: Any) -> Any:
        call = write(requests, **kw)
        read = call.read

        async def read_counted() -> Any:
            resp = await read()
            counted[0] += resp is not grpc.aio.EOF
            return resp

        call.read = read_counted
        return call

    clients.stream.WriteStream = counting  # type: ignore[method-assign]
    return counted


async def test_an_event_sink_writes_on_one_call(stream: StreamHarness, signer: Any, unique: str) -> None:
    """Deltas nobody waits for go without answers, in order; store() asks for the one answer."""
    key = f"session:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer)
    answers = count_answers(clients)
    try:
        with identity.acting_as("alice"):  # the runtime's writer acts for the turn's user
            sink = EventSink(clients, key)
        for i in range(50):
            sink.emit(events.reasoning_delta(f"{i} "))
            await asyncio.sleep(0)  # let the writer go: a delta per batch, or what queued meanwhile
        stored = await sink.store(events.reasoning_delta("end"))
        assert answers == [1]  # the batches before it were answered with it
        await sink.aclose()
        batches = [b async for b in sink.committed()]
    finally:
        await clients.close()
    offsets = [e.offset for b in batches for e in b]
    assert offsets[-1] == stored and len(offsets) == 51
    assert [as_int(o) for o in offsets] == sorted({as_int(o) for o in offsets})
    got = await collect(stream, key, reader="alice", idle_timeout_ms=200)
    assert [e.offset for e in got if events.kind(e) != "error"] == offsets  # no terminal yet: idles out
    assert "".join(texts([e for b in batches for e in b])) == "".join(f"{i} " for i in range(50)) + "end"
    assert (started(stream, "WriteStream", "bidi_stream"), started(stream, "AppendEvents", "unary")) == (1, 0)


async def test_an_event_sink_on_a_closed_buffer_is_cancelled(
    stream: StreamHarness, signer: Any, unique: str
) -> None:
    key = f"session:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer)
    try:
        sink = EventSink(clients, key)
        await sink.store(events.text_delta("a"))
        await close(stream, key)  # the turn was cancelled: its buffer closed under the writer
        sink.emit(events.text_delta("b"))
        with pytest.raises(Cancelled):
            await sink.flush()
        assert isinstance(sink.failure, Cancelled)
        assert [len(b) async for b in sink.committed()] == [1]
    finally:
        await clients.close()


@pytest.mark.redis
@pytest.mark.parametrize("mode", ["answered", "deferred", "held"])
async def test_an_event_sink_moves_on_from_a_drained_replica(
    redis_url: str, signer: Any, unique: str, stream_factory: StreamFactory, mode: str
) -> None:
    """Two replicas on one Redis: the replica the sink writes through stops (SIGTERM's drain) between
    batches; the next batch goes through the other one, and the buffer holds every event once: also
    when the batches before the stop went without answers (the stop answers them: none is resent),
    and when the stop came while the replica held a batch awaiting the turn's start (SHUTDOWN says it
    was not taken: it is sent again, through the other one, and lands right after the start)."""
    first = await stream_factory()
    if not isinstance(first.backend, RedisBackend):
        pytest.skip("replicas share buffers on Redis only")
    settings = service_settings(stream=first.settings.stream, shutdown_grace_s=2.0)
    backend = RedisBackend(redis_url, settings.stream, prefix=first.backend.prefix)
    second = await build(settings, "127.0.0.1:0", backend, signer)
    await second.start()
    key = f"session:{unique}"
    await create(first, key)
    clients = clients_for(first, signer, f"ipv4:{first.server.target},{second.target}")
    try:
        sink = EventSink(clients, key, await_start=mode == "held")
        holding = lambda: first.backend.subscribers + backend.subscribers == 1  # noqa: E731
        if mode == "deferred":  # the batches go unanswered: the stopping replica answers what it took
            for i in range(4):
                sink.emit(events.text_delta(f"{i} "))
                await wait_until(lambda i=i: _length(first, key, i + 1), what=f"batch {i} stored")
            offsets = [(await first.backend.info(key)).last_offset]
        elif mode == "held":  # one batch, held by a replica until the turn's start
            for i in range(4):
                sink.emit(events.text_delta(f"{i} "))
            await wait_until(holding, what="a replica holds the first batch")
            offsets = []
        else:
            offsets = [await sink.store(events.text_delta(f"{i} ")) for i in range(4)]
        writing = [
            s
            for s in (first.server, second)
            if s.registry.get_sample_value(
                "agentmesh_grpc_server_in_flight",
                {"grpc_service": SERVICE, "grpc_method": "WriteStream", "grpc_type": "bidi_stream"},
            )
        ]
        assert len(writing) == 1
        await writing[0].stop(30.0)
        live = backend if writing[0] is first.server else first.backend  # the replica still serving
        if mode == "held":
            await wait_until(holding, what="the other replica holds the batch sent again")
            assert (await live.info(key)).length == 0
            await live.append(key, [_start(unique)])
            assert (await asyncio.wait_for(sink.start(), 10)).assistant_message_id == 7
        offsets += [await sink.store(events.text_delta(f"{i} ")) for i in range(4, 8)]
        await sink.aclose()
        assert sink.failure is None
        found = await first.backend.info(key)  # a stopped server's backend still reads Redis
        held = mode == "held"
        assert (found.length, found.last_offset) == (8 + held, offsets[-1])  # every event once
        if held:
            got = [e async for e in live.subscribe(key, idle_timeout_ms=200)]
            assert events.kind(got[0]) == "start"
            assert "".join(e.text_delta.text_delta for e in got[1:9]) == "".join(f"{i} " for i in range(8))
        assert [as_int(o) for o in offsets] == sorted({as_int(o) for o in offsets})
    finally:
        await clients.close()
        await second.stop(1.0)
        await backend.aclose()


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
    key = f"session:{unique}"
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
    key = f"session:{unique}"
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
    key = f"session:{unique}"
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
    key = f"session:{unique}"
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


async def test_an_event_sink_awaiting_start_writes_after_it(
    stream: StreamHarness, signer: Any, unique: str
) -> None:
    """EventSink(await_start=True): its first delta is held by the stream service until the turn's
    `start`, then everything follows it; `start()` gives the placeholder; one write call in all."""
    key = f"session:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer)
    try:
        sink = EventSink(clients, key, await_start=True)
        sink.emit(events.reasoning_delta("first "))
        await wait_until(lambda: stream.backend.subscribers == 1, what="the first batch held")
        sink.emit(events.reasoning_delta("second"))
        assert (await info(stream, key)).length == 0
        await append(stream, key, [_start(unique)])
        assert (await asyncio.wait_for(sink.start(), 10)).assistant_message_id == 7
        await sink.aclose()
        assert sink.failure is None
    finally:
        await clients.close()
    got = await collect(stream, key, idle_timeout_ms=200)
    assert [events.kind(e) for e in got[:3]] == ["start", "reasoning_delta", "reasoning_delta"]
    assert "".join(texts(got)) == "first second"
    assert started(stream, "WriteStream", "bidi_stream") == 1


async def test_an_event_sink_asks_for_start_with_nothing_written(
    stream: StreamHarness, signer: Any, unique: str
) -> None:
    """A run whose first step wrote nothing (a tool call straight away) still learns its anchor; a
    buffer that ends before its start fails the sink with Cancelled, storing nothing."""
    ok, failed = f"session:{unique}", f"session:{unique}-failed"
    await create(stream, ok)
    await create(stream, failed)
    clients = clients_for(stream, signer)
    try:
        sink = EventSink(clients, ok, await_start=True)
        asked = asyncio.ensure_future(sink.start())
        await wait_until(lambda: stream.backend.subscribers == 1, what="the empty batch held")
        await append(stream, ok, [_start(unique)])
        assert (await asyncio.wait_for(asked, 10)).assistant_message_id == 7
        await sink.aclose()
        doomed = EventSink(clients, failed, await_start=True)
        doomed.emit(events.reasoning_delta("lost"))
        await wait_until(lambda: stream.backend.subscribers == 1, what="the doomed batch held")
        await close(stream, failed)
        with pytest.raises(Cancelled):
            await asyncio.wait_for(doomed.start(), 10)
        assert isinstance(doomed.failure, Cancelled)
        doomed.cancel()
    finally:
        await clients.close()
    assert [events.kind(e) for e in await collect(stream, ok, idle_timeout_ms=200)] == ["start", "error"]
    assert [events.kind(e) for e in await collect(stream, failed)] == ["done"]
