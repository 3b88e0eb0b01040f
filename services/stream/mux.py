"""Many follows, or many writers, on one call (StreamService.FollowStreams, WriteStreams).

A process that reads or writes many buffers at once (a gateway's readers, an agent runtime's runs)
sends and receives one gRPC message per burst this way, not one per buffer: each message wakes
several threads of both processes, and at a realistic model pace that, not the events, was most of
what a token cost.

A follow is a backend subscription (`StreamBackend.subscribe`) run in a task of its own; a writer
writes one key, its batches appended in order by a task of its own. What they produce waits in the
call's `Outbox`: everything that becomes ready in one pass of the event loop goes out in one response.
Both sides of the protocol: docs/design/streams.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from agentmesh.libs.errors import InvalidArgument, MeshError, Shutdown, as_mesh_error
from agentmesh.libs.ids import shown
from agentmesh.services.stream.backend import SHUTDOWN_READ, StreamBackend
from agentmesh.stream.v1 import stream_service_pb2 as pb

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 256  # events a follow is sent beyond what its reader granted back
MAX_FOLLOWS = 10_000  # follows at once on one call
MAX_WRITERS = 10_000  # writers at once on one call
MAX_RESPONSE_BYTES = 1 << 20  # a response is cut after about this much; the next one takes the rest
STOP_WAIT_S = 5.0  # at a stop, how long the batches being appended are waited for

R = TypeVar("R", pb.FollowStreamsResponse, pb.WriteStreamsResponse)
UserOf = Callable[[str], str]  # an identity token ("" = the call's caller) -> the acting user ("" = mesh)


class Outbox(Generic[R]):
    """The responses a call will send: what is added while the sender is busy (or in the same pass of
    the loop) goes in one response, cut at about MAX_RESPONSE_BYTES."""

    def __init__(self, make: Callable[[], R]) -> None:
        self._make: Callable[[], R] = make
        self._full: collections.deque[R] = collections.deque()
        self._current: R | None = None
        self._bytes = 0
        self._waiter: asyncio.Future[None] | None = None

    def response(self) -> R:
        """The response being filled (a new one once the last was taken)."""
        if self._current is None:
            self._current = self._make()
            self._bytes = 0
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)
        return self._current

    def added(self, size: int) -> None:
        """`size` bytes went into `response()`: past the bound, the next addition starts a new one."""
        self._bytes += size
        if self._bytes > MAX_RESPONSE_BYTES and self._current is not None:
            self._full.append(self._current)
            self._current = None

    def poke(self) -> None:
        """Wakes the sender with nothing new (something it waits on, beside the responses, changed)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __bool__(self) -> bool:
        return bool(self._full) or self._current is not None

    def take(self) -> R | None:
        if self._full:
            return self._full.popleft()
        current, self._current = self._current, None
        return current

    async def wait(self, *others: asyncio.Future[Any]) -> None:
        """Returns once there is something to take, or one of `others` is done."""
        if self:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait({self._waiter, *others}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._waiter.cancel()
            self._waiter = None


async def _read_requests(
    backend: StreamBackend, requests: AsyncIterable[Any], apply: Callable[[Any], None]
) -> None:
    """Applies the call's requests until the caller half-closes; Shutdown once the service stops."""
    async for request in backend.until_shutdown(requests):
        apply(request)


async def _serve(
    backend: StreamBackend,
    requests: AsyncIterable[Any],
    apply: Callable[[Any], None],
    outbox: Outbox[R],
    busy: Callable[[], bool],
    stop: Callable[[], Any],
) -> AsyncIterator[R]:
    """The responses of a call: `outbox` as it fills, until the caller half-closed and nothing is
    `busy` and nothing left to send; the reader's failure (Shutdown) once what is there went out."""
    reader = asyncio.ensure_future(_read_requests(backend, requests, apply))
    try:
        while True:
            await outbox.wait(reader)
            while (response := outbox.take()) is not None:
                yield response
            if reader.done():
                if reader.exception() is not None:
                    await stop()
                    while (response := outbox.take()) is not None:
                        yield response
                    raise reader.exception()  # type: ignore[misc]
                if not busy() and not outbox:
                    return
                await outbox.wait()
    finally:
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader


# --- follows ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Follow:
    id: int
    credit: int
    task: asyncio.Task[None] | None = None
    granted: asyncio.Future[None] | None = None  # the pump waits for credit
    slot: pb.StreamDelivery | None = None  # its delivery in the response being filled

    def grant(self, events: int) -> None:
        self.credit += events
        if self.granted is not None and not self.granted.done():
            self.granted.set_result(None)


class FollowCall:
    """The follows of one FollowStreams call."""

    def __init__(self, backend: StreamBackend, user_of: UserOf) -> None:
        self.backend = backend
        self.user_of = user_of
        self.follows: dict[int, _Follow] = {}
        self.outbox: Outbox[pb.FollowStreamsResponse] = Outbox(self._new_response)

    def _new_response(self) -> pb.FollowStreamsResponse:
        for follow in self.follows.values():
            follow.slot = None
        return pb.FollowStreamsResponse()

    def responses(self, requests: AsyncIterable[pb.FollowStreamsRequest]) -> AsyncIterator[Any]:
        return _serve(self.backend, requests, self.apply, self.outbox, lambda: bool(self.follows), self.stop)

    def apply(self, request: pb.FollowStreamsRequest) -> None:
        for item in request.follows:
            self._start(item)
        for follow_id in request.releases:
            follow = self.follows.pop(follow_id, None)
            if follow is not None and follow.task is not None:
                follow.task.cancel()
        for grant in request.grants:
            follow = self.follows.get(grant.id)
            if follow is not None:
                follow.grant(grant.events)

    def _start(self, item: pb.StreamFollow) -> None:
        if item.id in self.follows:
            taken = InvalidArgument(f"follow {item.id} is already in use on this call")
            self._end(_Follow(item.id, 0), taken)
            return
        follow = _Follow(item.id, item.window or DEFAULT_WINDOW)
        if len(self.follows) >= MAX_FOLLOWS:
            self._end(follow, InvalidArgument(f"at most {MAX_FOLLOWS} follows at once on one call"))
            return
        self.follows[item.id] = follow
        follow.task = asyncio.ensure_future(self._pump(follow, item))

    async def _pump(self, follow: _Follow, item: pb.StreamFollow) -> None:
        """The follow's subscription into the outbox, within its credit."""
        try:
            sub = item.subscription
            reader = self.user_of(item.identity)
            found = self.backend.subscribe(
                sub.key, sub.from_offset, reader, sub.idle_timeout_ms, sub.terminal_only
            )
            try:
                async for event in found:
                    while follow.credit <= 0:
                        follow.granted = asyncio.get_running_loop().create_future()
                        await follow.granted
                    follow.credit -= 1
                    self._slot(follow).events.append(event)
                    self.outbox.added(event.ByteSize())
            finally:
                await found.aclose()
        except MeshError as err:
            self._end(follow, err)
        except Exception as exc:  # the backend's own failure (Redis gone): the follow ends with it
            log.warning("a follow of %s failed", shown(item.subscription.key, 80), exc_info=True)
            self._end(follow, as_mesh_error(exc))
        else:
            self._end(follow)

    def _slot(self, follow: _Follow) -> pb.StreamDelivery:
        response = self.outbox.response()
        if follow.slot is None:
            follow.slot = response.deliveries.add(id=follow.id)
        return follow.slot

    def _end(self, follow: _Follow, err: MeshError | None = None) -> None:
        slot = self._slot(follow)  # while it is a follow of the call: a new response resets its slot
        if self.follows.get(follow.id) is follow:
            del self.follows[follow.id]
        slot.ended = True
        if err is not None:
            slot.error_reason, slot.error_message = err.reason, err.message
        follow.slot = None

    async def stop(self) -> None:
        """The service stops: every follow ends (SHUTDOWN: follow again elsewhere)."""
        tasks = [f.task for f in self.follows.values() if f.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        for follow in list(self.follows.values()):
            self._end(follow, Shutdown(SHUTDOWN_READ))

    def close(self) -> None:
        """The call ended: its follows stop."""
        for follow in self.follows.values():
            if follow.task is not None:
                follow.task.cancel()
        self.follows.clear()


# --- writers ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Writer:
    id: int
    key: str
    user: str
    since: str = ""  # an offset of the buffer it writes to, as it last named one (WriteStreamRequest.since)
    queue: collections.deque[pb.StreamBatch] = field(default_factory=collections.deque)
    deferred: list[str] = field(default_factory=list)  # offsets of batches taken since its last answer
    task: asyncio.Task[None] | None = None


class WriteCall:
    """The writers of one WriteStreams call."""

    def __init__(self, backend: StreamBackend, user_of: UserOf) -> None:
        self.backend = backend
        self.user_of = user_of
        self.writers: dict[int, _Writer] = {}
        # Writers that failed (their later batches are dropped), the newest MAX_WRITERS of them.
        self.failed: dict[int, None] = {}
        self.outbox: Outbox[pb.WriteStreamsResponse] = Outbox(pb.WriteStreamsResponse)
        self._stopping = False

    def responses(self, requests: AsyncIterable[pb.WriteStreamsRequest]) -> AsyncIterator[Any]:
        return _serve(self.backend, requests, self.apply, self.outbox, self._busy, self.stop)

    def _busy(self) -> bool:
        return any(w.queue or (w.task is not None and not w.task.done()) for w in self.writers.values())

    def apply(self, request: pb.WriteStreamsRequest) -> None:
        for batch in request.batches:
            if batch.writer in self.failed:
                continue
            writer = self.writers.get(batch.writer)
            if writer is None:
                writer = self._open(batch)
                if writer is None:
                    continue
            elif batch.batch.key and batch.batch.key != writer.key:
                self._fail(writer, InvalidArgument(
                    f"writer {writer.id} writes {writer.key}, not {shown(batch.batch.key, 80)}"
                ))  # fmt: skip
                continue
            writer.queue.append(batch)
            if writer.task is None or writer.task.done():
                writer.task = asyncio.ensure_future(self._write(writer))

    def _open(self, batch: pb.StreamBatch) -> _Writer | None:
        writer = _Writer(batch.writer, batch.batch.key, "")
        try:
            if not writer.key:
                raise InvalidArgument(f"the first batch of writer {writer.id} names no key")
            if len(self.writers) >= MAX_WRITERS:
                raise InvalidArgument(f"at most {MAX_WRITERS} writers at once on one call")
            writer.user = self.user_of(batch.identity)
        except MeshError as err:
            self._fail(writer, err)
            return None
        self.writers[writer.id] = writer
        return writer

    async def _write(self, writer: _Writer) -> None:
        """Appends the writer's queued batches in order; answers those that ask."""
        try:
            await self._write_queued(writer)
        finally:
            self.outbox.poke()  # a call half-closed by its caller ends once no writer is busy

    async def _write_queued(self, writer: _Writer) -> None:
        while writer.queue and not self._stopping:
            item = writer.queue.popleft()
            batch = item.batch
            try:
                writer.since = batch.since or writer.since
                offsets = await self.backend.append(
                    writer.key, batch.events, writer.user, writer.since, batch.producer, batch.sequence
                )
            except Shutdown:
                writer.queue.appendleft(item)  # not taken: the writer sends it again elsewhere
                return
            except MeshError as err:
                self._fail(writer, err)
                return
            except Exception as exc:  # the backend's own failure (Redis gone): the writer fails with it
                log.warning("a write to %s failed", shown(writer.key, 80), exc_info=True)
                self._fail(writer, as_mesh_error(exc))
                return
            if batch.defer_answer:
                writer.deferred += offsets
            else:
                self._answer(writer, pb.WriteStreamResponse(offsets=writer.deferred + offsets))
            if item.last:
                self.writers.pop(writer.id, None)
                return

    def _answer(self, writer: _Writer, answer: pb.WriteStreamResponse) -> None:
        writer.deferred = []
        item = self.outbox.response().answers.add(writer=writer.id)
        item.answer.CopyFrom(answer)
        self.outbox.added(item.ByteSize())

    def _fail(self, writer: _Writer, err: MeshError) -> None:
        self.writers.pop(writer.id, None)
        self.failed[writer.id] = None
        if len(self.failed) > MAX_WRITERS:
            del self.failed[next(iter(self.failed))]
        writer.queue.clear()
        item = self.outbox.response().answers.add(
            writer=writer.id, error_reason=err.reason, error_message=err.message
        )
        self.outbox.added(item.ByteSize())

    async def stop(self) -> None:
        """The service stops: no batch is taken any more; those taken are answered (their offsets). A
        batch still being appended after STOP_WAIT_S may be stored or not: it stays unanswered, and its
        writer sends it again after SHUTDOWN, stored once (WriteStreamRequest.producer)."""
        self._stopping = True
        tasks = [w.task for w in self.writers.values() if w.task is not None and not w.task.done()]
        if tasks:  # a batch being appended is finished; one awaiting its start ends (Shutdown)
            await asyncio.wait(tasks, timeout=STOP_WAIT_S)
        for writer in list(self.writers.values()):
            if writer.deferred:
                self._answer(writer, pb.WriteStreamResponse(offsets=writer.deferred))
            if writer.task is not None and not writer.task.done():
                writer.task.cancel()

    def close(self) -> None:
        for writer in self.writers.values():
            if writer.task is not None:
                writer.task.cancel()
        self.writers.clear()
