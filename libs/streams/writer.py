"""Many writers on one WriteStreams call: the `Writer` carries the batches of every writer of a process
(services/agent_runtime/sink.py's EventSink; the protocol: docs/design/streams.md)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from agentmesh.libs import identity
from agentmesh.libs.errors import MeshError, Unavailable, from_rpc_error
from agentmesh.libs.rpc import MAX_MESSAGE_BYTES
from agentmesh.libs.streams import end_calls
from agentmesh.libs.streams.reconnect import Reconnect, went_away
from agentmesh.stream.v1 import stream_service_pb2 as pb
from agentmesh.stream.v1 import stream_service_pb2_grpc

# A WriteStreams request carries the batches of many writers. One that grew past REQUEST_BYTES takes no
# more batches: the next ones go in another request. A batch stops at BATCH_BYTES (services/agent_runtime/
# sink.py) unless its first event alone is bigger, and one event may be up to EVENT_BYTES. So a request
# stays under gRPC's message limit, which would fail the whole call and every writer bound to it.
REQUEST_BYTES = 2 << 20
BATCH_BYTES = 1 << 20
EVENT_BYTES = MAX_MESSAGE_BYTES * 3 // 4


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class Feed:
    """The request iterator of one call, read by gRPC in a task of its own (behind the mesh's
    interceptors `call.write` would start tasks per message). gRPC takes a request once it wrote the
    one before, and `room()` waits for that, as `await call.write` would: a writer that outruns gRPC
    puts more in its next request instead of queueing requests."""

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._ended = False
        self._taker: asyncio.Future[None] | None = None  # gRPC waits for a request
        self._writer: asyncio.Future[None] | None = None  # the writer waits until gRPC takes one

    def put(self, item: Any) -> None:
        """Queues `item`."""
        self._items.append(item)
        _wake(self._taker)

    def end(self) -> None:
        """Nothing more after what was put (gRPC half-closes once it took that); releases `room()`."""
        self._ended = True
        _wake(self._taker)
        _wake(self._writer)

    @property
    def ended(self) -> bool:
        return self._ended

    async def room(self) -> None:
        """Returns once gRPC took every request put (or the feed ended)."""
        while self._items and not self._ended:
            self._writer = asyncio.get_running_loop().create_future()
            await self._writer

    async def requests(self) -> AsyncIterator[Any]:
        while True:
            if self._items:
                item = self._items.popleft()
                _wake(self._writer)
                yield item
            elif self._ended:
                return
            else:
                self._taker = asyncio.get_running_loop().create_future()
                await self._taker


class _Request:
    """A WriteStreams request being filled, its size counted batch by batch (each is filled after
    `add` hands it out, so it is counted at the next `add` or `full`)."""

    __slots__ = ("_bytes", "_last", "request")

    def __init__(self) -> None:
        self.request = pb.WriteStreamsRequest()
        self._bytes = 0
        self._last: pb.StreamBatch | None = None

    def add(self) -> pb.StreamBatch:
        self._count()
        self._last = self.request.batches.add()
        return self._last

    def full(self) -> bool:
        self._count()
        return self._bytes >= REQUEST_BYTES

    def _count(self) -> None:
        if self._last is not None:
            self._bytes += self._last.ByteSize()
            self._last = None


class Batches(Protocol):
    """What `Writer` asks of each writer it carries (services/agent_runtime/sink.py's EventSink)."""

    def take(self, current: WritesCall, slot: Callable[[WritesCall], pb.StreamBatch]) -> None:
        """Puts the writer's next batch, if it has one due, in `slot(call)`: on `current`, or on the
        call it is bound to while that one still owes it answers."""

    def answered(self, call: WritesCall, answer: pb.StreamBatchAnswer) -> None:
        """An answer to the writer's batches on `call` (offsets, or its failure)."""

    def call_ended(self, call: WritesCall, error: BaseException) -> None:
        """`call` ended (`error`: how) with the writer still bound to it."""

    def unreachable(self, error: MeshError) -> None:
        """The stream service did not answer again within the reconnect budget: the writer fails."""


class Writer:
    """The stream writes of one process (every EventSink of an agent runtime) on one WriteStreams call
    at a time. A writer with something to send says so (`ready`); the next request carries a batch of
    every writer ready by then, so a burst across buffers is one message. A request goes as soon as
    gRPC took the one before, but no sooner than `linger_s` after it unless a batch is `urgent` (a
    buffer's first, or one somebody waits for): when the model outruns nothing, nothing waits; when
    many buffers stream at once, they share each message. A call lives `life_s`; then new writers
    bind to a new one, while those that still await answers on the old one finish there."""

    def __init__(
        self,
        stub: Callable[[], stream_service_pb2_grpc.StreamServiceStub],
        life_s: float,
        linger_s: float,
        reconnect: Reconnect,
    ) -> None:
        self._stub = stub
        self._life_s = life_s
        self._linger_s = linger_s
        self._reconnect = reconnect
        self._down = False  # the last call failed as the service went away: wait before the next
        self._closed = False
        self._ready: dict[Batches, None] = {}
        self._urgent = False
        self._waiter: asyncio.Future[None] | None = None
        self._waiting_for = "work"  # or "linger": what the flusher waits for (who may wake it)
        self._last = 0.0  # when the last request went
        self._task: asyncio.Task[None] | None = None
        self._call: WritesCall | None = None
        self._calls: set[WritesCall] = set()

    def ready(self, writer: Batches, urgent: bool = False) -> None:
        """`writer` has a batch due (or an answer to ask for)."""
        if self._closed:
            writer.unreachable(Unavailable("the process closed its stream writes"))
            return
        self._ready[writer] = None
        self._urgent = self._urgent or urgent
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush_forever())
        elif self._waiting_for == "work" or urgent:
            _wake(self._waiter)

    def current(self) -> WritesCall:
        call = self._call
        loop = asyncio.get_running_loop()
        if call is None or call.done() or loop.time() - call.opened > self._life_s:
            if call is not None:
                call.retire()
            with identity.acting_as(""):  # the call is the mesh's; each writer carries its user
                call = self._call = WritesCall(self._stub().WriteStreams, self._call_done, self._reconnect)
            self._calls.add(call)
            timer = loop.call_at(call.opened + self._life_s, self._retire, call)
            call.reader.add_done_callback(lambda _: timer.cancel())
        return call

    def _call_done(self, call: WritesCall) -> None:
        self._calls.discard(call)
        if went_away(call.error) and not self._closed:
            self._down = True

    def _retire(self, call: WritesCall) -> None:
        """`call`'s life is over, even if nothing is sent: the writers that owe it answers ask for
        them there (a writer quiet since then would otherwise meet the call's deadline with its batches
        unanswered, and fail), then move on to a new call; the call half-closes once they left."""
        if call is self._call:
            self._call = None
        call.retire()
        for writer in list(call.writers.values()):
            self.ready(writer, urgent=True)

    async def _wait(self, what: str, timeout_s: float | None = None) -> None:
        self._waiting_for = what
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            if timeout_s is None:
                await self._waiter
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout_s):
                        await self._waiter
        finally:
            self._waiter = None
            self._waiting_for = ""

    async def _flush_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._ready:
                await self._wait("work")
                continue
            delay = self._last + self._linger_s - loop.time()
            if delay > 0 and not self._urgent:
                await self._wait("linger", delay)
                continue
            if self._down:  # the writers of the failed call send again once the service answers
                back = await self._reconnect.wait()
                self._down = False
                if not back:
                    self._give_up()
                    continue
            current = self.current()
            await current.room()  # gRPC took the last request: what queued meanwhile goes in this one
            if current.done() or current.retired:  # (retired meanwhile: new writers go to a new call)
                continue
            self._urgent = False
            self._flush(current)

    def _flush(self, current: WritesCall) -> None:
        ready, self._ready = self._ready, {}
        requests: dict[WritesCall, list[_Request]] = {}

        def slot(call: WritesCall) -> pb.StreamBatch:
            queued = requests.setdefault(call, [])
            if not queued or queued[-1].full():
                queued.append(_Request())
            return queued[-1].add()

        try:
            for writer in ready:
                writer.take(current, slot)
        finally:  # what was taken goes, whatever a writer's take raised
            for call, queued in requests.items():
                for request in queued:
                    call.send(request.request)
            if requests:
                self._last = asyncio.get_running_loop().time()

    def _give_up(self) -> None:
        ready, self._ready = self._ready, {}
        err = Unavailable(f"the stream service did not answer for {self._reconnect.budget_s:g} s")
        for writer in ready:
            writer.unreachable(err)

    async def aclose(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
        self._call = None
        calls, self._calls = list(self._calls), set()
        await end_calls(calls)


class WritesCall:
    """One WriteStreams call: requests put on its feed, a task reading the answers and routing them to
    the writers bound to it (each under an id of this call), and telling them when the call ends."""

    def __init__(self, method: Any, on_done: Callable[[WritesCall], None], reconnect: Reconnect) -> None:
        loop = asyncio.get_running_loop()
        self.opened = loop.time()
        self._reconnect = reconnect
        self.error: MeshError | None = None  # how it failed, once it did
        self.feed = Feed()
        self._ids = itertools.count(1)
        self.writers: dict[int, Batches] = {}
        self._retired = False
        self.call = method(self.feed.requests())
        self.reader = loop.create_task(self._read())
        self.reader.add_done_callback(lambda _: on_done(self))

    def done(self) -> bool:
        return self.reader.done()

    @property
    def retired(self) -> bool:
        return self._retired

    def bind(self, writer: Batches) -> int:
        """A new writer on this call: its id."""
        writer_id = next(self._ids)
        self.writers[writer_id] = writer
        return writer_id

    def unbind(self, writer_id: int) -> None:
        self.writers.pop(writer_id, None)
        if self._retired and not self.writers:
            self.feed.end()

    def abandon(self, writer_id: int) -> None:
        """A writer gives up: the service is told to forget it (its answers are ignored meanwhile)."""
        if writer_id in self.writers and not self.feed.ended:
            request = pb.WriteStreamsRequest()
            request.batches.add(writer=writer_id, last=True).batch.defer_answer = True
            self.feed.put(request)
        self.unbind(writer_id)

    def retire(self) -> None:
        """No new writers: the call half-closes once its writers left."""
        self._retired = True
        if not self.writers:
            self.feed.end()

    async def room(self) -> None:
        await self.feed.room()

    def send(self, request: pb.WriteStreamsRequest) -> None:
        self.feed.put(request)

    def cancel(self) -> None:
        self.feed.end()
        self.call.cancel()

    async def _read(self) -> None:
        error: BaseException = Unavailable("the stream service ended the write call")
        try:
            while (response := await self.call.read()) is not grpc.aio.EOF:
                self._reconnect.reset()
                for answer in response.answers:
                    writer = self.writers.get(answer.writer)
                    if writer is not None:
                        writer.answered(self, answer)
        except grpc.aio.AioRpcError as exc:
            error = exc
        except asyncio.CancelledError:  # the call was cancelled: it was given up
            error = Unavailable("the write call was cancelled")
        finally:
            self.feed.end()
            if self.writers:  # (a call half-closed once its writers left ends without owing any)
                self.error = error if isinstance(error, MeshError) else from_rpc_error(error)  # type: ignore[arg-type]
            writers, self.writers = list(self.writers.values()), {}
            for writer in writers:
                writer.call_ended(self, error)
