"""EventSink: the single ordered writer of one stream key.

`emit(event)` queues an event and returns at once; a writer task appends queued events to the
stream service in batches, so per-delta work on the hot path is a list append. The batches travel on
one long-lived WriteStream call per sink. A batch nobody waits for goes without asking for an answer
(`defer_answer`): the writer sends the next one as soon as gRPC took the one before (it is writing
it), so what queues meanwhile goes in one batch when the model outruns the writer, and a token costs
one message, not a request and its answer. The writer asks for an answer where someone needs the
offsets: `await sink.store(e)` (a2a-task-started before the callee starts), `flush()` and the close
(an empty batch asks when nothing else is queued), the turn's `start` (below), and every batch of a
`live` sink, whose `committed()` the runtime forwards as they are stored. An answer carries the
offsets of the batches it answers and of every deferred one before it; `committed()` yields the
batches, events carrying their offsets, in order, once answered.

Whatever fails ends the call with its status, and the writer learns of it when the call ends, whether
or not it waits for an answer: the sink fails and the run ends with its terminal event. A call that
ended with every batch answered (a replica drained or lost, its deadline) is replaced by a new one; a
batch without an answer is never sent twice, except after SHUTDOWN: a stopping stream service answers
every batch it took, then says SHUTDOWN, and the batches still unanswered (not appended) go again on
a new call. The write call opens with the sink, so it is ready by the time the model's first delta
arrives.

With `await_start` (a run started before its turn was stored: RunAgentRequest.await_start) the
first batch travels with WriteStreamRequest.await_start: the stream service holds it until the
turn's `start` is the buffer's first event and appends it right after (no round trip back to the
run in between), answering with that `start` (`started`: the placeholder the run's tools anchor
to). A buffer that ends first fails the sink: nothing of the run is stored.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from agentmesh.events.v1 import events_pb2
from agentmesh.stream.v1 import stream_service_pb2
from libs.clients import Clients
from libs.errors import Cancelled, Internal, MeshError, Shutdown, from_rpc_error, is_lost_send

_MAX_BATCH = 256
_MAX_UNANSWERED = 64  # batches on a call without an answer: then one asks (it bounds what is held)
_Entry = tuple[events_pb2.Event, "asyncio.Future[str] | None"]  # a future only where someone waits


@dataclass(eq=False)
class _Sent:
    """A batch sent on a write call and not answered yet (by its own answer or a later one)."""

    entries: list[_Entry]
    asked: bool  # it asked for its answer (no defer_answer): an answer ends with it
    start: bool  # it awaits the turn's start: only an answer carrying `start` answers it


class EventSink:
    def __init__(self, clients: Clients, key: str, await_start: bool = False, live: bool = False) -> None:
        self.clients = clients
        self.key = key
        # The turn's `start`, once the stream service holds it before this sink's first batch.
        self.started: asyncio.Future[events_pb2.TurnStart] | None = None
        if await_start:
            self.started = asyncio.get_running_loop().create_future()
        self._live = live  # every batch asks for its answer: committed() yields it once stored
        self._start_wanted = False  # someone needs `started` before anything was emitted
        self._flush_wanted = False  # someone waits until everything emitted is stored
        self._pending: list[_Entry] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued and nothing unanswered
        self._idle.set()
        self._out: asyncio.Queue[list[events_pb2.Event] | None] = asyncio.Queue()
        self._closed = False
        self._failure: MeshError | None = None
        self._shutdowns = 0  # SHUTDOWNs with no answer since the last one
        # A write call lives half its deadline (stream_rpc_timeout_s), then the next batch takes a new one.
        self._call_life_s = clients.settings.stream_rpc_timeout_s / 2
        self._call: _WriteCall | None = self._open()  # opened now: ready for the first delta
        self._writer = asyncio.create_task(self._write_loop(), name=f"sink:{key}")

    def _open(self) -> _WriteCall:
        return _WriteCall(self.clients, self._settle, self._wake.set)  # its end wakes the writer

    def emit(self, event: events_pb2.Event) -> None:
        """Queues `event` (dropped once the sink failed or closed: `failure` tells why)."""
        self._queue(event, None)

    async def store(self, event: events_pb2.Event) -> str:
        """Queues `event` and waits until it is stored; returns its offset (or raises the failure)."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue(event, fut)
        return await fut

    def _queue(self, event: events_pb2.Event, fut: asyncio.Future[str] | None) -> None:
        if self._failure is not None or self._closed:
            if fut is not None:
                fut.set_exception(self._failure or RuntimeError("sink closed"))
            return
        self._pending.append((event, fut))
        self._idle.clear()
        self._wake.set()

    @property
    def failure(self) -> MeshError | None:
        return self._failure

    async def start(self) -> events_pb2.TurnStart:
        """The turn's `start` (a sink made with `await_start`); asks for it with an empty batch when
        nothing was emitted yet. Raises the sink's failure."""
        assert self.started is not None, "this sink does not await its turn's start"
        if not self.started.done():
            self._start_wanted = True
            self._idle.clear()
            self._wake.set()
        return await asyncio.shield(self.started)

    def _asks_start(self) -> bool:
        """An empty batch is due: `start()` waits, nothing was sent that will bring the answer."""
        return self._start_wanted and self.started is not None and not self.started.done()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._write_due()
            except grpc.aio.AioRpcError as exc:
                err = from_rpc_error(exc)
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Someone closed the buffer under a running writer: the run was cancelled.
                    err = Cancelled(f"{self.key} was closed: {err.message}")
                self._fail(err)
                return
            except MeshError as err:
                self._fail(err)
                return
            if self._pending or (self._call is not None and self._call.unanswered):
                continue  # deferred batches: an answer (or the call's end) comes when someone asks
            self._flush_wanted = False
            self._idle.set()
            if self._closed:
                await self._end_call()
                self._out.put_nowait(None)
                return

    async def _write_due(self) -> None:
        """Sends what is due on the write call (opened, or replaced, as needed): the queued events in
        batches, or an empty batch asking for the answer that `start()`, a flush or the close waits
        for; waits for the answers asked for. A call that ended with batches unanswered raises its
        failure, or after SHUTDOWN hands them back to the queue."""
        while True:
            call = self._call
            if call is not None and call.done() and (call.unanswered or isinstance(call.error, MeshError)):
                self._ended_unanswered(call)
                continue
            asking = self._closed or self._flush_wanted
            unanswered = call is not None and bool(call.unanswered)
            if not (self._pending or self._asks_start() or (asking and unanswered)):
                return
            if call is None or call.done():  # it ended with nothing unanswered: write on a new one
                if call is not None:
                    call.cancel()
                call = self._call = self._open()
            await call.room()  # gRPC took the batch before: what queued meanwhile goes in this one
            if call.done():
                continue
            batch, self._pending = self._pending[:_MAX_BATCH], self._pending[_MAX_BATCH:]
            start = self.started is not None and not self.started.done()
            # Replaced before its deadline (with nothing unanswered, so no batch is left in doubt).
            retire = asyncio.get_running_loop().time() - call.opened > self._call_life_s
            waits = (
                start
                or retire
                or self._live
                or any(fut is not None for _, fut in batch)
                or ((self._closed or self._flush_wanted) and not self._pending)
            )
            sent = _Sent(batch, waits or len(call.unanswered) + 1 >= _MAX_UNANSWERED, start)
            call.send(self.key, sent)
            while waits and sent in call.unanswered and not call.done():
                await call.changed()  # its answer (or the call's end) comes
            if retire and self._call is call and not call.unanswered:
                call.retire()
                self._call = None

    def _ended_unanswered(self, call: _WriteCall) -> None:
        """A call ended with batches unanswered: after SHUTDOWN (the service stopped and took none of
        them), or when none of them reached the service (a send raced the call's end), they go back to
        the front of the queue, for a new call; else raises how it ended (a second such end with no
        answer between: the service keeps stopping under the writer)."""
        err = call.error or Internal(f"the stream service ended the write call of {self.key} early")
        if not isinstance(err, grpc.aio.AioRpcError):
            raise err
        # A send the call's end raced (grpc.aio then reports INTERNAL instead of the call's own status,
        # SHUTDOWN of a drain, say): what never reached the service is safe to send again.
        lost = is_lost_send(err) and len(call.unanswered) <= call.undelivered()
        if not (lost or isinstance(from_rpc_error(err), Shutdown)):
            raise err
        if self._shutdowns:
            raise Shutdown(f"the stream service kept shutting down under the writer of {self.key}")
        self._shutdowns += 1
        self._pending[:0] = [entry for sent in call.unanswered for entry in sent.entries]
        call.unanswered.clear()
        call.cancel()
        self._call = None

    def _settle(self, call: _WriteCall, resp: stream_service_pb2.WriteStreamResponse) -> None:
        """Gives an answer's offsets to the oldest unanswered batches, in order, up to the one that
        asked for it (a stopping service's last answer covers deferred batches alone)."""
        self._shutdowns = 0
        offsets, used, settled = resp.offsets, 0, 0
        while call.unanswered:
            sent = call.unanswered[0]
            size = len(sent.entries)
            if used + size > len(offsets) or (sent.start and not resp.HasField("start")):
                break
            call.unanswered.popleft()
            for (event, fut), offset in zip(sent.entries, offsets[used : used + size], strict=True):
                event.offset = offset
                if fut is not None and not fut.done():
                    fut.set_result(offset)
            used += size
            settled += 1
            if sent.start and self.started is not None and not self.started.done():
                self.started.set_result(resp.start)
            self._out.put_nowait([event for event, _ in sent.entries])
            if sent.asked:
                break
        if used != len(offsets) or not settled:
            raise Internal(
                f"the stream service answered {len(offsets)} offsets for the batches of {self.key}"
            )

    async def _end_call(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            await call.end(5.0)

    def _fail(self, err: MeshError) -> None:
        self._failure = err
        if self.started is not None and not self.started.done():
            self.started.set_exception(err)
        unanswered = [e for sent in self._call.unanswered for e in sent.entries] if self._call else []
        for _, fut in unanswered + self._pending:
            if fut is not None and not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._idle.set()
        self._out.put_nowait(None)
        if self._call is not None:
            self._call.unanswered.clear()
            self._call.cancel()
            self._call = None

    async def flush(self) -> None:
        """Waits until everything emitted so far is stored (raises the append error, if any)."""
        if not self._idle.is_set():
            self._flush_wanted = True
            self._wake.set()
        await self._idle.wait()
        if self._failure is not None:
            raise self._failure

    async def aclose(self) -> None:
        """Flushes and stops the writer; `committed()` ends after the last event."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._writer)

    def cancel(self) -> None:
        self._closed = True
        self._writer.cancel()
        if self.started is not None and not self.started.done():
            self.started.cancel()
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self._idle.set()
        self._out.put_nowait(None)

    async def committed(self) -> AsyncIterator[list[events_pb2.Event]]:
        while True:
            batch = await self._out.get()
            if batch is None:
                return
            yield batch


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


class _Feed:
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

    def put(self, item: Any) -> None:
        self._items.append(item)
        self.put_count += 1
        _wake(self._taker)

    def end(self) -> None:
        """Nothing more after what was put (gRPC half-closes once it took that); releases `room()`."""
        self._ended = True
        _wake(self._taker)
        _wake(self._writer)

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


class _WriteCall:
    """One WriteStream call: `send` a batch (it goes once gRPC took the one before: `room()`); a
    task of its own reads the answers as they come (`on_answer`) and the call's end (`on_end`), so a
    writer that asked for no answer still learns at once that the call failed (and gRPC hands over
    the call's status only once every answer was read)."""

    def __init__(
        self,
        clients: Clients,
        on_answer: Callable[[_WriteCall, stream_service_pb2.WriteStreamResponse], None],
        on_end: Callable[[], None],
    ) -> None:
        self._feed = _Feed()
        self.call = clients.stream.WriteStream(self._feed.requests())
        self.unanswered: collections.deque[_Sent] = collections.deque()
        self.opened = asyncio.get_running_loop().time()
        self.error: Exception | None = None  # how the call ended, when it failed
        self._changed = asyncio.Event()  # an answer came, or the end
        self._reader = asyncio.get_running_loop().create_task(self._read(on_answer, on_end))
        _READERS.add(self._reader)
        self._reader.add_done_callback(_READERS.discard)

    async def _read(
        self,
        on_answer: Callable[[_WriteCall, stream_service_pb2.WriteStreamResponse], None],
        on_end: Callable[[], None],
    ) -> None:
        try:
            while (resp := await self.call.read()) is not grpc.aio.EOF:
                on_answer(self, resp)
                self._changed.set()
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        except MeshError as err:  # an answer that does not fit the batches sent
            self.error = err
            self.call.cancel()
        except asyncio.CancelledError:  # the call was cancelled: it was given up
            self.error = Internal("the write call was cancelled")
        finally:
            self._feed.end()
            self._changed.set()
            on_end()

    def done(self) -> bool:
        return self._reader.done()

    async def changed(self) -> None:
        """Returns once an answer came or the call ended (since the last wait)."""
        self._changed.clear()
        await self._changed.wait()

    async def room(self) -> None:
        await self._feed.room()

    def undelivered(self) -> int:
        """How many of the last requests sent never reached the service (gRPC did not write them)."""
        return self._feed.put_count - self._feed.written

    def send(self, key: str, sent: _Sent) -> None:
        self.unanswered.append(sent)
        self._feed.put(
            stream_service_pb2.WriteStreamRequest(
                key=key,
                events=[event for event, _ in sent.entries],
                await_start=sent.start,
                defer_answer=not sent.asked,
            )
        )

    async def end(self, timeout_s: float) -> None:
        """Half-closes and waits (a bounded while) until the call is read to its end, so that what wraps
        its answers (a tracing span) ends too; every batch was answered, so how it ends changes nothing."""
        self._feed.end()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._reader), timeout_s)
        self.call.cancel()

    def retire(self) -> None:
        """Half-closes a call whose every batch was answered: the service ends it, the reader reads
        that end (nothing is waited for here)."""
        self._feed.end()

    def cancel(self) -> None:
        """Ends the call (when it still runs) and its request feed; the reader sees the end."""
        self._feed.end()
        self.call.cancel()


_READERS: set[asyncio.Task[None]] = set()  # the calls' readers (the loop keeps only weak references)
