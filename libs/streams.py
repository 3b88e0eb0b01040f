"""Many buffers on one call: following them (StreamService.FollowStreams: what the gateway's readers and
the orchestrator's turns use, one call for all of a process's follows) and writing them (WriteStreams:
what an agent runtime's EventSinks write through).

`Follower.follow(key, ...)` follows one buffer, as an async iterator of events: replay after the
offset, then live, up to the terminal event. All the follows of a process share one call:
what becomes ready for any of them in one pass of the stream service's loop comes in one message, and
a new follow is a request on the open call, not a new call. Each follow carries a token of the user
acting when it was made (the call itself is the mesh's), so the stream service checks the reader of
each buffer as it checks a call's caller.

A follow that fails raises its MeshError (by the reason its delivery carries); one whose call failed
raises Unavailable (follow again from the last offset); one cancelled with `cancel()` raises
`FollowCancelled`. The reader grants the service more events as it consumes
them (half a window at a time), so one that stops reading holds its place in the buffer, not a queue.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.libs.errors import Cancelled, MeshError, Unavailable, from_reason, from_rpc_error
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import MAX_MESSAGE_BYTES
from agentmesh.stream.v1 import stream_service_pb2 as pb
from agentmesh.stream.v1 import stream_service_pb2_grpc

WINDOW = 256  # events the service may send a follow beyond what its reader consumed
# A WriteStreams request carries the batches of many writers. One that grew past REQUEST_BYTES takes no
# more batches: the next ones go in another request. A batch stops at BATCH_BYTES (services/agent_runtime/
# sink.py) unless its first event alone is bigger, and one event may be up to EVENT_BYTES. So a request
# stays under gRPC's message limit, which would fail the whole call and every writer bound to it.
REQUEST_BYTES = 2 << 20
BATCH_BYTES = 1 << 20
EVENT_BYTES = MAX_MESSAGE_BYTES * 3 // 4


class FollowCancelled(Cancelled):
    """The follow was ended by its own reader (`Follow.cancel()`)."""


def acting_token(signer: Signer) -> str:
    """A token of the user acting now, for an item of a call opened as the mesh ("": the mesh itself)."""
    principal = identity.current()
    if principal is None or principal.is_mesh:
        return ""
    return signer.mint(principal.user)


class Follow:
    """One follow: its events as they come (the last one terminal), or its failure raised."""

    def __init__(self, follower: Follower, request: pb.StreamFollow) -> None:
        self._follower = follower
        self.request = request
        self.id = request.id
        self._events: collections.deque[ev.Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: MeshError | None = None
        self._unacked = 0  # consumed since the last grant
        self._call: _FollowCall | None = None

    def __aiter__(self) -> Follow:
        return self

    async def __anext__(self) -> ev.Event:
        while not self._events:
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        event = self._events.popleft()
        self._unacked += 1
        if self._unacked >= WINDOW // 2 and not self._ended and self._call is not None:
            self._call.grant(self.id, self._unacked)
            self._unacked = 0
        return event

    @property
    def ended(self) -> bool:
        return self._ended

    def cancel(self) -> None:
        """Stops following (the service lets go); a reader waiting gets FollowCancelled."""
        if self._ended:
            return
        if self._call is not None:
            self._call.release(self.id)  # before the end, which may half-close a retired call
        self._end(FollowCancelled(f"the follow of {self.request.subscription.key} was cancelled"))

    def _deliver(self, delivery: pb.StreamDelivery) -> None:
        if self._ended:
            return
        self._events.extend(delivery.events)
        if delivery.ended:
            failed = delivery.error_reason
            self._end(from_reason(failed, delivery.error_message) if failed else None)
        else:
            self._wake()

    def _end(self, err: MeshError | None) -> None:
        self._ended = True
        self._error = err
        if self._call is not None:
            self._call.forget(self.id)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Follower:
    """The follows of one process, on one FollowStreams call at a time (a call lives half the streaming
    deadline, then new follows go on a new one while the old one ends with its last follow)."""

    def __init__(
        self, stub: Callable[[], stream_service_pb2_grpc.StreamServiceStub], signer: Signer, life_s: float
    ) -> None:
        self._stub = stub
        self._signer = signer
        self._life_s = life_s
        self._ids = itertools.count(1)
        self._call: _FollowCall | None = None
        self._calls: set[_FollowCall] = set()

    def follow(
        self, key: str, from_offset: str = "", idle_timeout_ms: int = 0, terminal_only: bool = False
    ) -> Follow:
        """Follows `key` after `from_offset` as the user acting now (started at once: a caller may start
        it before it reads)."""
        request = pb.StreamFollow(
            id=next(self._ids),
            subscription=pb.SubscribeStreamRequest(
                key=key, from_offset=from_offset, idle_timeout_ms=idle_timeout_ms, terminal_only=terminal_only
            ),
            identity=acting_token(self._signer),
            window=WINDOW,
        )
        follow = Follow(self, request)
        self._current().add(follow)
        return follow

    def _current(self) -> _FollowCall:
        call = self._call
        loop = asyncio.get_running_loop()
        if call is None or call.done() or loop.time() - call.opened > self._life_s:
            if call is not None:
                call.retire()
            with identity.acting_as(""):  # the call is the mesh's; each follow carries its reader
                call = self._call = _FollowCall(self._stub().FollowStreams, self._calls.discard)
            self._calls.add(call)
        return call

    async def aclose(self) -> None:
        """Ends every call (their follows raise Unavailable)."""
        self._call = None
        calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()
        for call in calls:
            with contextlib.suppress(BaseException):
                await call.reader


class _FollowCall:
    """One FollowStreams call: requests gathered in one pass of the loop go as one message; a task
    reads the deliveries and hands them to their follows."""

    def __init__(self, method: Any, on_done: Callable[[_FollowCall], None]) -> None:
        loop = asyncio.get_running_loop()
        self.opened = loop.time()
        self._follows: dict[int, Follow] = {}
        self._queue: asyncio.Queue[pb.FollowStreamsRequest | None] = asyncio.Queue()
        self._pending: pb.FollowStreamsRequest | None = None
        self._retired = False
        self._half_closed = False
        self.call = method(self._requests())
        self.reader = loop.create_task(self._read())
        self.reader.add_done_callback(lambda _: on_done(self))

    def done(self) -> bool:
        return self.reader.done()

    async def _requests(self) -> AsyncIterator[pb.FollowStreamsRequest]:
        while (request := await self._queue.get()) is not None:
            yield request

    def _request(self) -> pb.FollowStreamsRequest:
        """The request going out at the end of this pass of the loop."""
        if self._pending is None:
            self._pending = pb.FollowStreamsRequest()
            asyncio.get_running_loop().call_soon(self._send)
        return self._pending

    def _send(self) -> None:
        request, self._pending = self._pending, None
        if request is not None and not self._half_closed:
            self._queue.put_nowait(request)

    def add(self, follow: Follow) -> None:
        follow._call = self
        self._follows[follow.id] = follow
        self._request().follows.append(follow.request)

    def release(self, follow_id: int) -> None:
        if not self.done():
            self._request().releases.append(follow_id)

    def grant(self, follow_id: int, events: int) -> None:
        if not self.done():
            self._request().grants.add(id=follow_id, events=events)

    def forget(self, follow_id: int) -> None:
        """The follow ended (here or at the service)."""
        self._follows.pop(follow_id, None)
        if self._retired and not self._follows:
            self._half_close()

    def retire(self) -> None:
        """No new follows: the call half-closes once its follows ended."""
        self._retired = True
        if not self._follows:
            self._half_close()

    def _half_close(self) -> None:
        if not self._half_closed:
            self._send()
            self._half_closed = True
            self._queue.put_nowait(None)

    def cancel(self) -> None:
        self._half_close()
        self.call.cancel()

    async def _read(self) -> None:
        err: MeshError = Unavailable("the stream service ended the follow call")
        try:
            async for response in self.call:
                for delivery in response.deliveries:
                    follow = self._follows.get(delivery.id)
                    if follow is not None:
                        follow._deliver(delivery)
        except grpc.aio.AioRpcError as exc:
            cause = from_rpc_error(exc)
            err = Unavailable(f"the follow call to the stream service ended: {cause.message}")
            if cause.reason == "SHUTDOWN":
                err = cause
        except asyncio.CancelledError:
            err = Unavailable("the follow call was cancelled")
        finally:
            self._half_close()
            for follow in list(self._follows.values()):
                follow._end(err)
            self._follows.clear()


# --- writes ----------------------------------------------------------------------------------------


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
        self.put_count = 0  # requests put
        self.written = 0  # requests gRPC wrote (it asks for the next one only once it wrote one)
        self._ended = False
        self._taker: asyncio.Future[None] | None = None  # gRPC waits for a request
        self._writer: asyncio.Future[None] | None = None  # the writer waits until gRPC takes one

    def put(self, item: Any) -> int:
        """Queues `item`; returns its number (1, 2, ...: compare with `written`)."""
        self._items.append(item)
        self.put_count += 1
        _wake(self._taker)
        return self.put_count

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
                self.written += 1
            elif self._ended:
                return
            else:
                self._taker = asyncio.get_running_loop().create_future()
                await self._taker


class Ticket:
    """The request a batch went in: `seq` once it was put on its call's feed (0 before)."""

    __slots__ = ("seq",)

    def __init__(self) -> None:
        self.seq = 0


class _Request:
    """A WriteStreams request being filled, its size counted batch by batch (each is filled after
    `add` hands it out, so it is counted at the next `add` or `full`)."""

    __slots__ = ("_bytes", "_last", "request", "ticket")

    def __init__(self) -> None:
        self.request = pb.WriteStreamsRequest()
        self.ticket = Ticket()
        self._bytes = 0
        self._last: pb.StreamBatch | None = None

    def add(self) -> tuple[pb.StreamBatch, Ticket]:
        self._count()
        self._last = self.request.batches.add()
        return self._last, self.ticket

    def full(self) -> bool:
        self._count()
        return self._bytes >= REQUEST_BYTES

    def _count(self) -> None:
        if self._last is not None:
            self._bytes += self._last.ByteSize()
            self._last = None


class Batches(Protocol):
    """What `Writer` asks of each writer it carries (services/agent_runtime/sink.py's EventSink)."""

    def take(self, current: WritesCall, slot: Callable[[WritesCall], tuple[pb.StreamBatch, Ticket]]) -> None:
        """Puts the writer's next batch, if it has one due, in `slot(call)`: on `current`, or on the
        call it is bound to while that one still owes it answers."""

    def answered(self, call: WritesCall, answer: pb.StreamBatchAnswer) -> None:
        """An answer to the writer's batches on `call` (offsets, or its failure)."""

    def call_ended(self, call: WritesCall, error: BaseException | None) -> None:
        """`call` ended (`error`: how, when it failed) with the writer still bound to it."""


class Writer:
    """The stream writes of one process (every EventSink of an agent runtime) on one WriteStreams call
    at a time. A writer with something to send says so (`ready`); the next request carries a batch of
    every writer ready by then, so a burst across buffers is one message. A request goes as soon as
    gRPC took the one before, but no sooner than `linger_s` after it unless a batch is `urgent` (a
    buffer's first, or one somebody waits for): when the model outruns nothing, nothing waits; when
    many buffers stream at once, they share each message. A call lives `life_s`; then new writers
    bind to a new one, while those that still await answers on the old one finish there."""

    def __init__(
        self, stub: Callable[[], stream_service_pb2_grpc.StreamServiceStub], life_s: float, linger_s: float
    ) -> None:
        self._stub = stub
        self._life_s = life_s
        self._linger_s = linger_s
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
                call = self._call = WritesCall(self._stub().WriteStreams, self._calls.discard)
            self._calls.add(call)
            timer = loop.call_at(call.opened + self._life_s, self._retire, call)
            call.reader.add_done_callback(lambda _: timer.cancel())
        return call

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
            current = self.current()
            await current.room()  # gRPC took the last request: what queued meanwhile goes in this one
            if current.done() or current.retired:  # (retired meanwhile: new writers go to a new call)
                continue
            self._urgent = False
            self._flush(current)

    def _flush(self, current: WritesCall) -> None:
        ready, self._ready = self._ready, {}
        requests: dict[WritesCall, list[_Request]] = {}

        def slot(call: WritesCall) -> tuple[pb.StreamBatch, Ticket]:
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
                    request.ticket.seq = call.send(request.request)
            if requests:
                self._last = asyncio.get_running_loop().time()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._call = None
        calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()
        for call in calls:
            with contextlib.suppress(BaseException):
                await call.reader


class WritesCall:
    """One WriteStreams call: requests put on its feed, a task reading the answers and routing them to
    the writers bound to it (each under an id of this call), and telling them when the call ends."""

    def __init__(self, method: Any, on_done: Callable[[WritesCall], None]) -> None:
        loop = asyncio.get_running_loop()
        self.opened = loop.time()
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

    def send(self, request: pb.WriteStreamsRequest) -> int:
        return self.feed.put(request)

    def delivered(self, ticket: Ticket) -> bool:
        """The request of `ticket` reached the service (gRPC wrote it)."""
        return 0 < ticket.seq <= self.feed.written

    def cancel(self) -> None:
        self.feed.end()
        self.call.cancel()

    async def _read(self) -> None:
        error: BaseException | None = None
        try:
            while (response := await self.call.read()) is not grpc.aio.EOF:
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
            writers, self.writers = list(self.writers.values()), {}
            for writer in writers:
                writer.call_ended(self, error)
