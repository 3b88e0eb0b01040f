"""WriteStreams, many writers on one call, over real gRPC on the memory and Redis backends: batches of
several writers in one request, each writer answered apart (its deferred batches with its next
answer), acting as the user of its own token, failing alone, waiting for nothing of the others; a stop
answers what it took, then SHUTDOWN (a batch whose append it cannot wait for fails its writer, never to
be sent again). Then EventSink over it through the process's Writer: what queues
goes in one batch, batches go unanswered until someone needs their offsets, the sinks of many buffers
share each message after their first batch, a closed buffer cancels the run, a drained replica's
writers carry on through another one, and the turn's `start` gates the first batch. (The one-key
WriteStream call: test_write_stream.py. The stream service SIGKILLed mid-turn: tests/e2e/cli/test_faults.py.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import (
    Cancelled,
    FailedPrecondition,
    Interrupted,
    MeshError,
    ResourceExhausted,
    Shutdown,
    Unavailable,
    from_rpc_error,
)
from agentmesh.libs.identity import Signer
from agentmesh.services.agent_runtime.sink import EventSink
from agentmesh.services.stream import mux
from agentmesh.services.stream.backend import StreamBackend
from agentmesh.services.stream.memory import MemoryBackend
from agentmesh.services.stream.redis_backend import RedisBackend
from agentmesh.services.stream.server import build
from agentmesh.stream.v1 import stream_service_pb2 as pb
from tests.conftest import service_settings
from tests.integration.stream.conftest import (
    RedisRelay,
    StreamFactory,
    StreamHarness,
    append,
    as_int,
    close,
    collect,
    create,
    deltas,
    info,
)
from tests.mesh import wait_until

SERVICE = "agentmesh.stream.v1.StreamService"


def texts(got: list[ev.Event]) -> list[str]:
    return [e.reasoning_delta.reasoning_delta for e in got if events.kind(e) == "reasoning_delta"]


def thoughts(*texts: str) -> list[ev.Event]:
    return [events.reasoning_delta(t) for t in texts]


class Writes:
    """One WriteStreams call driven request by request, reading its answers as they come."""

    def __init__(self, h: StreamHarness, caller: str = "") -> None:
        self.requests: asyncio.Queue[pb.WriteStreamsRequest | None] = asyncio.Queue()
        with identity.acting_as(caller):
            self.call = h.stub.WriteStreams(self._feed())
        self.answers: dict[int, list[pb.StreamBatchAnswer]] = {}
        self.responses = 0
        self.changed = asyncio.Event()
        self.reader = asyncio.ensure_future(self._read())

    async def _feed(self) -> AsyncIterator[pb.WriteStreamsRequest]:
        while (request := await self.requests.get()) is not None:
            yield request

    async def _read(self) -> grpc.StatusCode:
        try:
            async for response in self.call:
                self.responses += 1
                for answer in response.answers:
                    self.answers.setdefault(answer.writer, []).append(answer)
                self.changed.set()
        except grpc.aio.AioRpcError as exc:
            self.error = exc
            return exc.code()
        finally:
            self.changed.set()
        return grpc.StatusCode.OK

    def send(self, *batches: pb.StreamBatch) -> None:
        self.requests.put_nowait(pb.WriteStreamsRequest(batches=batches))

    async def answer(self, writer: int, n: int = 1) -> pb.StreamBatchAnswer:
        """The writer's n-th answer, once it came."""
        await wait_until(lambda: len(self.answers.get(writer, [])) >= n, what=f"answer {n} of {writer}")
        return self.answers[writer][n - 1]

    async def end(self) -> grpc.StatusCode:
        self.requests.put_nowait(None)
        return await asyncio.wait_for(self.reader, 10)


def batch(
    writer: int,
    *texts: str,
    key: str = "",
    identity: str = "",
    defer: bool = False,
    last: bool = False,
) -> pb.StreamBatch:
    return pb.StreamBatch(
        writer=writer,
        batch=pb.WriteStreamRequest(
            key=key,
            events=[events.reasoning_delta(t) for t in texts],
            defer_answer=defer,
        ),
        identity=identity,
        last=last,
    )


async def test_writers_of_many_buffers_share_a_request_and_are_answered_apart(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """One request carries batches of two writers, each acting as the user of its token: each is
    answered with its own offsets, in order, and each buffer holds its own events."""
    a, b = f"trace:{unique}-a", f"trace:{unique}-b"
    await create(stream, a, owner="alice")
    await create(stream, b, owner="bob")
    writes = Writes(stream)
    writes.send(
        batch(1, "a1", key=a, identity=signer.mint("alice"), defer=True),
        batch(2, "b1", "b2", key=b, identity=signer.mint("bob")),
        batch(1, "a2"),
    )
    first_a, first_b = await writes.answer(1), await writes.answer(2)
    assert len(first_a.answer.offsets) == 2 and len(first_b.answer.offsets) == 2  # a1 deferred, then a2
    writes.send(batch(2, "b3", defer=True), batch(2, last=True))
    assert len((await writes.answer(2, 2)).answer.offsets) == 1  # the deferred one with the last
    assert await writes.end() == grpc.StatusCode.OK
    assert writes.responses <= 3
    got_a = await collect(stream, a, reader="alice", idle_timeout_ms=200)
    got_b = await collect(stream, b, reader="bob", idle_timeout_ms=200)
    assert texts(got_a) == ["a1", "a2"] and texts(got_b) == ["b1", "b2", "b3"]
    assert [e.offset for e in got_a[:2]] == list(first_a.answer.offsets)
    offsets = [*first_b.answer.offsets, *writes.answers[2][1].answer.offsets]
    assert [e.offset for e in got_b[:3]] == offsets
    assert [as_int(o) for o in offsets] == sorted({as_int(o) for o in offsets})


async def test_a_writer_acts_as_the_user_of_its_token(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """Another user's token reads the buffer as missing, a forged one is refused, no token is the
    call's caller (here the mesh itself, which writes any buffer): each writer alone, the call goes on."""
    key = f"trace:{unique}"
    await create(stream, key, owner="alice")
    forged = signer.mint("alice")[:-4] + "AAAA"
    writes = Writes(stream)
    writes.send(
        batch(1, "bob's", key=key, identity=signer.mint("bob")),
        batch(2, "forged", key=key, identity=forged),
        batch(3, "mesh", key=key),
        batch(4, "alice's", key=key, identity=signer.mint("alice")),
    )
    assert (await writes.answer(1)).error_reason == "NOT_FOUND"
    assert (await writes.answer(2)).error_reason == "UNAUTHENTICATED"
    assert len((await writes.answer(3)).answer.offsets) == 1
    assert len((await writes.answer(4)).answer.offsets) == 1
    assert await writes.end() == grpc.StatusCode.OK
    got = texts(await collect(stream, key, reader="alice", idle_timeout_ms=200))
    assert sorted(got) == ["alice's", "mesh"]  # writers are independent: either may go first


async def test_a_writer_acting_as_a_user_on_a_users_call_is_that_users(
    stream: StreamHarness, unique: str
) -> None:
    """A call opened as bob carries bob's writers (no token): alice's buffer reads as missing to them."""
    key = f"trace:{unique}"
    await create(stream, key, owner="alice")
    writes = Writes(stream, caller="bob")
    writes.send(batch(1, "x", key=key))
    assert (await writes.answer(1)).error_reason == "NOT_FOUND"
    assert await writes.end() == grpc.StatusCode.OK
    assert (await info(stream, key)).length == 0


async def test_a_failed_writer_fails_alone_and_its_later_batches_are_dropped(
    stream: StreamHarness, unique: str
) -> None:
    closed, open_ = f"trace:{unique}-closed", f"trace:{unique}-open"
    await create(stream, closed)
    await create(stream, open_)
    writes = Writes(stream)
    writes.send(batch(1, "kept", key=closed), batch(2, "one", key=open_, defer=True))
    await writes.answer(1)
    await close(stream, closed)
    writes.send(batch(1, "refused", defer=True), batch(2, "two"))
    failed = await writes.answer(1, 2)
    assert failed.error_reason == "FAILED_PRECONDITION" and "is closed" in failed.error_message
    assert len((await writes.answer(2)).answer.offsets) == 2
    writes.send(batch(1, "dropped"), batch(2, "three"))
    assert len((await writes.answer(2, 2)).answer.offsets) == 1
    assert len(writes.answers[1]) == 2  # the failed writer's later batch: neither appended nor answered
    assert await writes.end() == grpc.StatusCode.OK
    assert texts(await collect(stream, closed)) == ["kept"]
    assert texts(await collect(stream, open_, idle_timeout_ms=200)) == ["one", "two", "three"]


@pytest.mark.parametrize(
    ("case", "reason", "message"),
    [
        ("no-key", "INVALID_ARGUMENT", "names no key"),
        ("invalid", "INVALID_ARGUMENT", "invalid stream key"),
        ("unknown", "NOT_FOUND", "no stream buffer"),
        ("second-key", "INVALID_ARGUMENT", "writes trace:"),
        ("after-last", "INVALID_ARGUMENT", "names no key"),
    ],
)
async def test_a_bad_batch_fails_its_writer_with_a_clear_error(
    stream: StreamHarness, unique: str, case: str, reason: str, message: str
) -> None:
    mine, other = f"trace:{unique}", f"a2a:{unique}"
    await create(stream, mine)
    await create(stream, other)
    writes = Writes(stream)
    n = 1
    if case in ("second-key", "after-last"):
        writes.send(batch(1, "first", key=mine, last=case == "after-last"))
        await writes.answer(1)
        n = 2
    first = {"no-key": "", "invalid": "nonsense", "unknown": f"subagent:{unique}", "second-key": other}
    writes.send(batch(1, "x", key=first.get(case, "")))
    answer = await writes.answer(1, n)
    assert answer.error_reason == reason and message in answer.error_message, answer
    assert await writes.end() == grpc.StatusCode.OK
    assert (await info(stream, other)).length == 0  # nothing reached another buffer
    assert (await info(stream, mine)).length == (1 if n == 2 else 0)


async def test_an_append_that_outlasts_the_stop_stays_unanswered_and_is_stored_once_when_sent_again(
    stream_factory: StreamFactory, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch stored whose append has not returned when the stop's wait runs out (a slow backend)
    stays unanswered: its writer sends it again after SHUTDOWN, with the same producer and sequence,
    and the buffer keeps it once. Another writer's deferred batch is still answered with its offset."""
    monkeypatch.setattr(mux, "STOP_WAIT_S", 0.2)
    h = await stream_factory()
    slow, other = f"trace:{unique}-slow", f"trace:{unique}-other"
    for key in (slow, other):
        await create(h, key)
    stored, never = asyncio.Event(), asyncio.Event()
    real = h.backend.append

    async def append_then_hang(
        key: str, batch: Any, writer: str = "", since: str = "", producer: str = "", sequence: int = 0
    ) -> list[str]:
        offsets = await real(key, batch, writer, since, producer, sequence)
        if key == slow:
            stored.set()
            await never.wait()  # its answer is lost (a backend that applied it and then stalled)
        return offsets

    monkeypatch.setattr(h.backend, "append", append_then_hang)
    writes = Writes(h)
    first = batch(1, "s1", key=slow)
    first.batch.producer, first.batch.sequence = "p1", 0
    writes.send(first, batch(2, "o1", key=other, defer=True))
    await asyncio.wait_for(stored.wait(), 10)
    await wait_until(lambda: _length(h, other, 1), what="the deferred batch stored")
    await asyncio.wait_for(h.server.stop(30.0), 5)
    assert await asyncio.wait_for(writes.reader, 10) == grpc.StatusCode.UNAVAILABLE
    assert isinstance(from_rpc_error(writes.error), Shutdown), writes.error
    assert 1 not in writes.answers  # neither stored nor failed, as far as its writer knows
    assert [len(x.answer.offsets) for x in writes.answers[2]] == [1]
    again = await real(slow, first.batch.events, "", "", "p1", 0)  # what its writer does next
    assert again == [""]
    assert (await h.backend.info(slow)).length == 1


async def test_a_producers_batch_sent_again_is_stored_once_and_a_gap_is_refused(
    stream: StreamHarness, unique: str
) -> None:
    """The backend keeps, per producer, how many of its events a buffer holds: a batch sent again is
    skipped (offsets ""), one overlapping in part stores only its new events, one starting past them
    is a gap (FailedPrecondition); another producer counts apart."""
    key = f"trace:{unique}"
    await create(stream, key)
    b = stream.backend
    first = await b.append(key, thoughts("a", "b"), producer="p", sequence=0)
    assert all(first) and len(first) == 2
    assert await b.append(key, thoughts("a", "b"), producer="p", sequence=0) == ["", ""]
    overlap = await b.append(key, thoughts("b", "c"), producer="p", sequence=1)
    assert overlap[0] == "" and as_int(overlap[1]) > as_int(first[1])
    with pytest.raises(FailedPrecondition, match="never stored"):
        await b.append(key, thoughts("e"), producer="p", sequence=4)
    assert all(await b.append(key, thoughts("x"), producer="q", sequence=0))
    assert texts(await collect(stream, key, idle_timeout_ms=200)) == ["a", "b", "c", "x"]


async def _length(h: StreamHarness, key: str, n: int) -> bool:
    return (await h.backend.info(key)).length == n


# --- EventSink over the process's Writer ---------------------------------------------------------------


@dataclass
class Tap:
    """What the WriteStreams calls of a Clients sent and received (the real calls, read through)."""

    calls: int = 0
    requests: list[pb.WriteStreamsRequest] = field(default_factory=list)
    answers: list[pb.StreamBatchAnswer] = field(default_factory=list)

    @property
    def batches(self) -> list[pb.StreamBatch]:
        return [b for r in self.requests for b in r.batches]


def tapped(clients: Clients) -> Tap:
    tap = Tap()
    real = clients.stream.WriteStreams

    def write_streams(requests: AsyncIterator[pb.WriteStreamsRequest], **kw: Any) -> Any:
        tap.calls += 1

        async def recorded() -> AsyncIterator[pb.WriteStreamsRequest]:
            async for request in requests:
                tap.requests.append(request)
                yield request

        call = real(recorded(), **kw)
        read = call.read

        async def read_tapped() -> Any:
            resp = await read()
            if resp is not grpc.aio.EOF:
                tap.answers.extend(resp.answers)
            return resp

        call.read = read_tapped
        return call

    clients.stream.WriteStreams = write_streams  # type: ignore[method-assign]
    return tap


def clients_for(h: StreamHarness, signer: Signer, target: str = "", **stream: Any) -> Clients:
    settings = h.settings.model_copy(deep=True)
    settings.addresses.stream = target or h.server.target
    for name, value in stream.items():
        setattr(settings.stream, name, value)
    return Clients(settings, signer)


def writing_through(*servers: Any) -> list[Any]:
    """The one server of `servers` a WriteStreams call is in flight on (asserted: exactly one)."""
    labels = {"grpc_service": SERVICE, "grpc_method": "WriteStreams", "grpc_type": "bidi_stream"}
    writing = [s for s in servers if s.registry.get_sample_value("agentmesh_grpc_server_in_flight", labels)]
    assert len(writing) == 1, writing
    return writing


def words(batch: pb.StreamBatch) -> list[str]:
    return [e.text_delta.text_delta or e.reasoning_delta.reasoning_delta for e in batch.batch.events]


async def test_an_event_sink_batches_what_queued_and_asks_only_when_needed(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """The first delta goes at once; what queues meanwhile goes in the next batch, consecutive deltas
    nobody waits for as one; batches nobody waits for go unanswered, and store() asks once for all."""
    key = f"trace:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer)
    tap = tapped(clients)
    try:
        with identity.acting_as("alice"):  # the runtime's writer acts for the turn's user
            sink = EventSink(clients, key)
        sink.emit(events.text_delta("a"))
        await wait_until(lambda: len(tap.batches) == 1, what="the first batch")
        for t in "bcd":  # "a" is on its way: these wait for the next batch
            sink.emit(events.text_delta(t))
        stored = await sink.store(events.text_delta("e"))
        await sink.aclose()
    finally:
        await clients.close()
    assert [words(b) for b in tap.batches] == [["a"], ["bcd", "e"], []]
    assert [b.batch.defer_answer for b in tap.batches] == [True, False, False]  # store() asked; the last
    assert tap.batches[0].batch.key == key and not tap.batches[1].batch.key  # the key once per call
    assert [b.last for b in tap.batches] == [False, False, True] and tap.calls == 1
    found = await collect(stream, key, reader="alice", idle_timeout_ms=200)  # text deltas merged
    assert [(e.text_delta.text_delta, e.offset) for e in found if e.HasField("text_delta")] == [
        ("abcde", stored)
    ]


async def test_sinks_of_many_buffers_share_each_message_after_their_first(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """With a linger, each sink's first batch goes at once (a turn's first delta waits for nothing), and
    the later deltas of every sink streaming at once go in one message."""
    keys = [f"trace:{unique}-{i}" for i in range(3)]
    for key in keys:
        await create(stream, key)
    clients = clients_for(stream, signer, linger_ms=300.0)
    tap = tapped(clients)
    try:
        sinks = [EventSink(clients, key) for key in keys]
        for i, sink in enumerate(sinks):
            sink.emit(events.text_delta(f"first {i}"))
            await wait_until(lambda i=i: len(tap.batches) == i + 1, timeout=0.25, what=f"first batch {i}")
        for i, sink in enumerate(sinks):
            sink.emit(events.text_delta(f"second {i}"))
        await wait_until(lambda: len(tap.batches) == 6, what="the second deltas")
        assert len(tap.requests) == 4  # three first batches, one at a time; then one for the rest
        assert sorted(words(b)[0] for b in tap.requests[-1].batches) == [f"second {i}" for i in range(3)]
        for sink in sinks:
            await sink.aclose()
    finally:
        await clients.close()
    for i, key in enumerate(keys):
        got = await collect(stream, key, idle_timeout_ms=200)
        assert [e.text_delta.text_delta for e in got if events.kind(e) == "text_delta"] == [
            f"first {i}second {i}"  # a reader gets consecutive text deltas merged
        ]


async def test_a_sink_holds_a_bounded_number_of_unanswered_batches(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """Every 64th batch in a row asks for its answer: what a sink holds for its answers stays bounded
    however long the run."""
    key = f"trace:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer, linger_ms=0.0)
    tap = tapped(clients)
    try:
        sink = EventSink(clients, key)
        for i in range(70):
            sink.emit(events.text_delta(f"{i}"))
            await wait_until(lambda i=i: len(tap.batches) == i + 1, what=f"batch {i} sent")
        assert [i for i, b in enumerate(tap.batches) if not b.batch.defer_answer] == [63]
        await wait_until(lambda: len(sink._unanswered) == 6, what="the 64th answered")
        await sink.aclose()
    finally:
        await clients.close()
    got = await collect(stream, key, idle_timeout_ms=200)  # text deltas merged
    assert "".join(e.text_delta.text_delta for e in got if e.HasField("text_delta")) == "".join(
        f"{i}" for i in range(70)
    )


async def test_a_write_call_is_replaced_before_its_deadline(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """Past half its deadline (stream_rpc_timeout_s) a write call takes no new writer, and a writer
    with batches unanswered on it asks for their answer there before it moves on: no batch is left in
    doubt at the deadline. The old call ends once its writers left."""
    key = f"trace:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer, linger_ms=0.0)
    tap = tapped(clients)
    try:
        sink = EventSink(clients, key)
        sink.emit(events.text_delta("a"))
        await wait_until(lambda: len(tap.batches) == 1, what="the first batch")
        first = clients.writes.current()
        clients.writes._retire(first)  # the call's life is over (its timer: half its deadline)
        sink.emit(events.text_delta("b"))
        await wait_until(lambda: len(tap.batches) == 2, what="the second batch")
        assert not tap.batches[1].batch.defer_answer  # asked: "a" and "b" answered on the old call
        await wait_until(first.done, what="the old call ended")
        sink.emit(events.text_delta("c"))
        await sink.aclose()
        assert sink.failure is None
    finally:
        await clients.close()
    assert tap.calls == 2 and tap.batches[2].batch.key == key  # announced again on the new call
    got = await collect(stream, key, idle_timeout_ms=200)
    assert [e.text_delta.text_delta for e in got if events.kind(e) == "text_delta"] == ["abc"]


async def test_a_closed_buffer_under_the_writer_cancels_the_run_unasked(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """The buffer closed under the writer while its batches went unanswered: the writer's failed
    answer alone tells, and the sink fails Cancelled (the run ends with its terminal event)."""
    key = f"trace:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer, linger_ms=0.0)
    tap = tapped(clients)
    try:
        sink = EventSink(clients, key)
        sink.emit(events.text_delta("kept"))
        await wait_until(lambda: _length(stream, key, 1), what="the first batch stored")
        await close(stream, key)  # the turn was cancelled
        sink.emit(events.text_delta("refused"))
        failure = await wait_until(lambda: sink.failure, what="the sink to learn of the failure")
        assert isinstance(failure, Cancelled)
        assert all(b.batch.defer_answer for b in tap.batches)  # nobody asked
        sink.emit(events.text_delta("dropped"))
        with pytest.raises(Cancelled):
            await sink.flush()
    finally:
        await clients.close()
    assert [e.text_delta.text_delta for e in await collect(stream, key) if e.HasField("text_delta")] == [
        "kept"
    ]


async def test_a_stream_service_gone_for_longer_than_the_reconnect_budget_fails_the_sink(
    stream_factory: StreamFactory, signer: Signer, unique: str
) -> None:
    """The stream service stops and does not come back: the sink's writer waits out its reconnect
    budget (stream.reconnect_s), then the sink fails UNAVAILABLE naming how long it waited."""
    h = await stream_factory()
    key = f"trace:{unique}"
    await create(h, key)
    clients = clients_for(h, signer, reconnect_s=0.5)
    try:
        sink = EventSink(clients, key)
        await sink.store(events.text_delta("a"))
        await h.server.stop(1.0)
        sink.emit(events.text_delta("b"))
        with pytest.raises(Unavailable, match="did not answer"):
            await asyncio.wait_for(sink.flush(), 10)
        sink.cancel()
    finally:
        await clients.close()


@pytest.mark.parametrize("backend_kind", [pytest.param("redis", marks=pytest.mark.redis)], indirect=True)
async def test_a_writer_whose_backend_loses_redis_fails_and_is_answered_so(
    stream_factory: StreamFactory, redis_relay: RedisRelay, signer: Signer, unique: str
) -> None:
    """Redis goes away under a writer (the backend's own ConnectionError, not a MeshError): the writer
    is answered with the failure, UNAVAILABLE (the caller may try again later, it is no bug of ours),
    nothing of it is answered as written, and the call ends when asked."""
    h = await stream_factory(via=redis_relay.url)
    key = f"trace:{unique}"
    await create(h, key, owner="alice")
    writes = Writes(h)
    writes.send(batch(1, "w1", key=key, identity=signer.mint("alice")))
    assert len((await writes.answer(1)).answer.offsets) == 1
    redis_relay.cut()
    writes.send(batch(1, "w2", defer=True), batch(1, "w3"))
    failed = await asyncio.wait_for(_answer_or_failure(writes, 1, 2), 30)
    assert failed.error_reason == "UNAVAILABLE" and "Redis" in failed.error_message
    assert not failed.answer.offsets
    assert await writes.end() == grpc.StatusCode.OK


async def _answer_or_failure(writes: Writes, writer: int, n: int) -> pb.StreamBatchAnswer:
    while len(writes.answers.get(writer, [])) < n:
        writes.changed.clear()
        await writes.changed.wait()
    return writes.answers[writer][n - 1]


async def test_big_events_of_several_sinks_go_in_requests_apart_and_one_too_big_fails_alone(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """The sinks ready at once share a request, which must stay under gRPC's message limit: past it the
    call fails, and with it every sink on it. Two sinks with a 9 MB event each and a third with a small
    one, emitted together: all stored, the big ones in requests of their own. An event no request could
    carry (13 MB) fails its own sink with ResourceExhausted; the others go on."""
    keys = [f"trace:{unique}-{i}" for i in range(4)]
    for key in keys:
        await create(stream, key)
    clients = clients_for(stream, signer)
    tap = tapped(clients)
    big = ["a" * 9_000_000, "b" * 9_000_000]
    try:
        sinks = [EventSink(clients, key) for key in keys]
        for sink, text in zip(sinks, [*big, "small"], strict=False):
            sink.emit(events.text_delta(text))  # one pass of the loop: the three are ready together
        for sink in sinks[:3]:
            await asyncio.wait_for(sink.flush(), 30)
        assert [len(r.batches) for r in tap.requests[:2]] == [1, 1]  # each big batch alone
        sinks[3].emit(events.text_delta("c" * 13_000_000))
        with pytest.raises(ResourceExhausted, match="over the"):
            await asyncio.wait_for(sinks[3].flush(), 30)
        sinks[0].emit(events.text_delta(" more"))
        for sink in sinks[:3]:
            await asyncio.wait_for(sink.aclose(), 30)
    finally:
        await clients.close()
    stored = [await collect(stream, key, idle_timeout_ms=200) for key in keys[:3]]
    assert [
        "".join(e.text_delta.text_delta for e in got if events.kind(e) == "text_delta") for got in stored
    ] == [big[0] + " more", big[1], "small"]


async def test_a_quiet_sink_settles_its_batches_on_a_call_retired_in_its_silence(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """A write call retires at half its deadline even when nothing is sent then: a sink quiet since its
    last batch, which nobody asked an answer for, asks for it on that call, so the call's deadline finds
    nothing in doubt (a run quiet for a long tool failed DEADLINE_EXCEEDED, its events all stored)."""
    key = f"trace:{unique}"
    await create(stream, key)
    settings = stream.settings.model_copy(deep=True)
    settings.addresses.stream = stream.server.target
    settings.stream_rpc_timeout_s = 2.0  # a call lives 1 s, and dies at 2 s
    clients = Clients(settings, signer)
    tap = tapped(clients)
    try:
        sink = EventSink(clients, key)
        sink.emit(events.text_delta("a"))
        await wait_until(lambda: len(tap.batches) == 1, what="the first batch")
        assert tap.batches[0].batch.defer_answer  # nobody waits for it: unanswered
        first = clients.writes._call
        assert first is not None
        await wait_until(first.done, timeout=10, what="the first call's end")
        assert sink.failure is None and not sink._unanswered
        assert not tap.batches[1].batch.defer_answer and not tap.batches[1].batch.events  # it asked
        sink.emit(events.text_delta("b"))
        await sink.aclose()
        assert sink.failure is None
    finally:
        await clients.close()
    got = await collect(stream, key, idle_timeout_ms=200)
    assert [e.text_delta.text_delta for e in got if events.kind(e) == "text_delta"] == ["ab"]


async def test_an_idle_sink_leaves_a_retired_call_which_then_ends(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """A sink that owes nothing on a call when the call retires leaves it at once, so the call
    half-closes and ends, instead of staying open to its deadline for a sink with nothing to say."""
    key = f"trace:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer)
    try:
        sink = EventSink(clients, key)
        await sink.store(events.text_delta("a"))  # answered: nothing owed
        first = clients.writes._call
        assert first is not None
        clients.writes._retire(first)
        await wait_until(first.done, what="the retired call's end")
        assert sink.failure is None
        await sink.store(events.text_delta("b"))  # on a new call
        assert clients.writes._call is not first
        await sink.aclose()
    finally:
        await clients.close()
    got = await collect(stream, key, idle_timeout_ms=200)
    assert [e.text_delta.text_delta for e in got if events.kind(e) == "text_delta"] == ["ab"]


async def test_a_write_naming_an_earlier_buffer_of_its_key_writes_nothing(
    stream: StreamHarness, unique: str
) -> None:
    """A writer whose buffer is gone (closed and replaced by the next turn's; on memory, also lost with a
    restarted process) names it by an offset it was given (`since`): AppendEvents, CloseStream and a
    WriteStreams writer fail ABORTED (INTERRUPTED), and the newer buffer, another turn's, holds none of
    it; naming the newer buffer's own offset writes as before."""
    key = f"trace:{unique}"
    await create(stream, key)
    (old,) = await append(stream, key, deltas("old"))
    await close(stream, key)
    await create(stream, key)  # the next turn's buffer
    (new,) = await append(stream, key, deltas("new"))
    stray = deltas("stray")
    refused: list[grpc.aio.AioRpcError] = []
    for attempt in (
        stream.stub.AppendEvents(pb.AppendEventsRequest(key=key, events=stray, since=old)),
        stream.stub.CloseStream(
            pb.CloseStreamRequest(key=key, events=stray, done=ev.StreamDone(), since=old)
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await attempt
        refused.append(err.value)
    for err in refused:
        assert err.code() == grpc.StatusCode.ABORTED, err.details()
        assert "this write was for" in (err.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await stream.stub.AppendEvents(pb.AppendEventsRequest(key=key, events=stray, since="x1"))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.value.details()
    writes = Writes(stream)
    gone, mine = batch(1, "stray", key=key), batch(2, "mine", key=key)
    gone.batch.since, mine.batch.since = old, new
    writes.send(gone, mine)
    interrupted = await writes.answer(1)
    assert interrupted.error_reason == "INTERRUPTED" and "this write was for" in interrupted.error_message
    assert len((await writes.answer(2)).answer.offsets) == 1
    assert await writes.end() == grpc.StatusCode.OK
    ended = await stream.stub.CloseStream(pb.CloseStreamRequest(key=key, done=ev.StreamDone(), since=new))
    assert ended.closed
    got = await collect(stream, key, reader="alice")
    assert [e.text_delta.text_delta for e in got if e.HasField("text_delta")] == ["new"]
    assert texts(got) == ["mine"] and events.kind(got[-1]) == "done"


async def test_a_buffer_made_again_in_the_millisecond_of_its_last_entry_is_told_apart(
    stream: StreamHarness, unique: str
) -> None:
    """Redis: the next turn's buffer can be made in the millisecond of the old one's last entry (or with
    the server's clock behind it); its first offset is still above every old one, so a write or a read
    naming the old buffer is refused instead of landing in the new one. The old buffer's last entry is
    put a minute ahead here, so the create always shares or trails its millisecond."""
    if not isinstance(stream.backend, RedisBackend):
        pytest.skip("the memory backend counts its offsets from its own clock, above its key's last")
    key = f"trace:{unique}"
    await create(stream, key)
    await append(stream, key, deltas("old"))
    await close(stream, key)
    _, stream_key, _ = stream.backend._keys(key)
    ahead = await stream.backend.client.execute_command("TIME")
    last = f"{int(ahead[0]) * 1000 + 60_000}-0"
    added = await stream.backend.client.xadd(stream_key, {"e": b"", "g": "old"}, id=last)
    old = added.decode() if isinstance(added, bytes) else added
    await create(stream, key)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.stub.AppendEvents(pb.AppendEventsRequest(key=key, events=deltas("stray"), since=old))
    assert err.value.code() == grpc.StatusCode.ABORTED, err.value.details()
    with pytest.raises(MeshError) as gone:
        await collect(stream, key, reader="alice", from_offset=old, idle_timeout_ms=100)
    assert gone.value.grpc_code == grpc.StatusCode.NOT_FOUND, gone.value.message
    (new,) = await append(stream, key, deltas("new"))
    assert tuple(map(int, new.split("-"))) > tuple(map(int, old.split("-")))


async def test_a_sink_whose_buffer_was_replaced_fails_instead_of_writing_into_the_new_one(
    stream_factory: StreamFactory, redis_url: str, signer: Signer, unique: str
) -> None:
    """The chaos run's duplicated words: a run's sink moved to a new call (its stream service restarted
    or drained) while its turn's buffer had been replaced by the next turn's (on memory, the restart
    lost it and the next turn made the key again). Announcing its key there, it wrote into the newer
    turn's buffer; now it names its buffer by the offset it was last answered, and fails INTERRUPTED,
    the newer buffer holding none of it."""
    first = await stream_factory()
    settings = service_settings(stream=first.settings.stream, shutdown_grace_s=2.0)
    memory = not isinstance(first.backend, RedisBackend)
    # A second server, as the process the sink's next call reaches: on Redis over the same buffers, on
    # memory over its own (whichever server the sink's call went to, the key is replaced on both).
    other: StreamBackend = MemoryBackend(settings.stream)
    if isinstance(first.backend, RedisBackend):
        other = RedisBackend(redis_url, settings.stream, prefix=first.backend.prefix)
    second = await build(settings, "127.0.0.1:0", other, signer)
    await second.start()
    backends = [first.backend, other] if memory else [first.backend]
    key = f"trace:{unique}"
    for b in backends:
        await b.create(key, "alice", {"agent": "demo"})
    clients = clients_for(first, signer, f"ipv4:{first.server.target},{second.target}", linger_ms=0.0)
    try:
        with identity.acting_as("alice"):
            sink = EventSink(clients, key)
        await sink.store(events.text_delta("mine "))
        for b in backends:  # the turn's buffer ends; the next turn makes the key again and writes
            await b.close(key, ev.Event(done=ev.StreamDone()))
            await b.create(key, "alice", {"agent": "demo"})
            await b.append(key, deltas("theirs"))
        writing = writing_through(first.server, second)
        await writing[0].stop(30.0)  # the sink's call ends: its next batch goes on a new one
        sink.emit(events.text_delta("stray"))
        with pytest.raises(Interrupted) as err:
            await asyncio.wait_for(sink.flush(), 10)
        assert "this write was for" in err.value.message
        sink.cancel()
        live = other if writing[0] is first.server else first.backend
        got = [e async for e in live.subscribe(key, idle_timeout_ms=200)]
        assert [e.text_delta.text_delta for e in got if e.HasField("text_delta")] == ["theirs"]
    finally:
        await clients.close()
        await second.stop(1.0)
        await other.aclose()


async def test_a_stop_answers_what_it_took_then_shutdown(stream_factory: StreamFactory, unique: str) -> None:
    """Every writer's deferred batches are answered before SHUTDOWN."""
    h = await stream_factory()
    a, b = f"trace:{unique}-a", f"trace:{unique}-b"
    for key in (a, b):
        await create(h, key)
    writes = Writes(h)
    writes.send(
        batch(1, "a1", key=a, defer=True),
        batch(2, "b1", "b2", key=b, defer=True),
    )
    await wait_until(lambda: _length(h, b, 2), what="the deferred batches stored")
    await asyncio.wait_for(h.server.stop(30.0), 5)
    assert await asyncio.wait_for(writes.reader, 10) == grpc.StatusCode.UNAVAILABLE
    assert isinstance(from_rpc_error(writes.error), Shutdown), writes.error
    assert [len(x.answer.offsets) for x in writes.answers[1]] == [1]
    assert [len(x.answer.offsets) for x in writes.answers[2]] == [2]


@pytest.mark.redis
@pytest.mark.parametrize("mode", ["answered", "deferred"])
async def test_an_event_sink_moves_on_from_a_drained_replica(
    redis_url: str, signer: Signer, unique: str, stream_factory: StreamFactory, mode: str
) -> None:
    """Two replicas on one Redis: the replica the sink writes through stops (SIGTERM's drain) between
    batches; the next batch goes through the other one, and the buffer holds every event once: also
    when the batches before the stop went without answers (the stop answers them: none is resent)."""
    first = await stream_factory()
    if not isinstance(first.backend, RedisBackend):
        pytest.skip("replicas share buffers on Redis only")
    settings = service_settings(stream=first.settings.stream, shutdown_grace_s=2.0)
    backend = RedisBackend(redis_url, settings.stream, prefix=first.backend.prefix)
    second = await build(settings, "127.0.0.1:0", backend, signer)
    await second.start()
    key = f"trace:{unique}"
    await create(first, key)
    clients = clients_for(first, signer, f"ipv4:{first.server.target},{second.target}", linger_ms=0.0)
    try:
        sink = EventSink(clients, key)
        if mode == "deferred":  # the batches go unanswered: the stopping replica answers what it took
            for i in range(4):
                sink.emit(events.text_delta(f"{i} "))
                await wait_until(lambda i=i: _length(first, key, i + 1), what=f"batch {i} stored")
            offsets = [(await first.backend.info(key)).last_offset]
        else:
            offsets = [await sink.store(events.text_delta(f"{i} ")) for i in range(4)]
        writing = writing_through(first.server, second)
        await writing[0].stop(30.0)
        offsets += [await sink.store(events.text_delta(f"{i} ")) for i in range(4, 8)]
        await sink.aclose()
        assert sink.failure is None
        found = await first.backend.info(key)  # a stopped server's backend still reads Redis
        assert (found.length, found.last_offset) == (8, offsets[-1])  # every event once
        assert [as_int(o) for o in offsets] == sorted({as_int(o) for o in offsets})
    finally:
        await clients.close()
        await second.stop(1.0)
        await backend.aclose()


async def test_a_cancelled_sink_fails_whoever_waits_for_a_store(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """`store()` waits for its event's offset: a sink given up (its run gone) ends that wait with
    Cancelled, for an event still queued; nothing is appended."""
    key = f"trace:{unique}"
    await create(stream, key)
    clients = clients_for(stream, signer)
    try:
        sink = EventSink(clients, key)
        queued = asyncio.ensure_future(sink.store(events.reasoning_delta("queued")))
        sink.cancel()  # before the writer ran: the event is still queued
        with pytest.raises(Cancelled, match=r"gave up|not stored"):
            await asyncio.wait_for(queued, 10)
    finally:
        await clients.close()
    assert (await info(stream, key)).length == 0
