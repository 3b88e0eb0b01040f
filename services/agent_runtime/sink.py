"""EventSink: the single ordered writer of one stream key.

`emit(event)` queues an event and returns at once; a writer task appends queued events to the
stream service in batches (everything that queued up while the previous batch was in flight goes in
the next), so per-delta work on the hot path is a list append. The batches travel on one long-lived
WriteStream call per sink, each answered with its offsets: a message each way per batch instead of a
unary call. A call that ended between batches (a replica drained or lost, its deadline) is replaced
by a new one; a batch without an answer is never sent twice, except after SHUTDOWN, which says it was
not appended. `committed()` yields the stored batches, events carrying their offsets, in order.
`await sink.store(e)` when the caller must know the event is durable before going on
(a2a-task-started before the callee starts). The write call opens with the sink, so it is ready
by the time the model's first delta arrives.

With `await_start` (a run started before its turn was stored: RunAgentRequest.await_start) the
first batch travels with WriteStreamRequest.await_start: the stream service holds it until the
turn's `start` is the buffer's first event and appends it right after (no round trip back to the
run in between), answering with that `start` (`started`: the placeholder the run's tools anchor
to). A buffer that ends first fails the sink: nothing of the run is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from agentmesh.events.v1 import events_pb2
from agentmesh.stream.v1 import stream_service_pb2
from libs.clients import AskCall, Clients
from libs.errors import Cancelled, Internal, MeshError, Shutdown, from_rpc_error

_MAX_BATCH = 256
_Entry = tuple[events_pb2.Event, "asyncio.Future[str] | None"]  # a future only where someone waits


class EventSink:
    def __init__(self, clients: Clients, key: str, await_start: bool = False) -> None:
        self.clients = clients
        self.key = key
        # The turn's `start`, once the stream service holds it before this sink's first batch.
        self.started: asyncio.Future[events_pb2.TurnStart] | None = None
        if await_start:
            self.started = asyncio.get_running_loop().create_future()
        self._start_wanted = False  # someone needs `started` before anything was emitted
        self._pending: list[_Entry] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued and nothing in flight
        self._idle.set()
        self._out: asyncio.Queue[list[events_pb2.Event] | None] = asyncio.Queue()
        self._closed = False
        self._failure: MeshError | None = None
        self._call: _WriteCall | None = _WriteCall(clients)  # opened now: ready for the first delta
        self._writer = asyncio.create_task(self._write_loop(), name=f"sink:{key}")

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
            while self._pending or self._asks_start():
                self._start_wanted = False
                batch, self._pending = self._pending[:_MAX_BATCH], self._pending[_MAX_BATCH:]
                try:
                    offsets = await self._append([e for e, _ in batch])
                except grpc.aio.AioRpcError as exc:
                    err = from_rpc_error(exc)
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        # Someone closed the buffer under a running writer: the run was cancelled.
                        err = Cancelled(f"{self.key} was closed: {err.message}")
                    self._fail(err, batch)
                    return
                except MeshError as err:
                    self._fail(err, batch)
                    return
                for (event, fut), offset in zip(batch, offsets, strict=True):
                    event.offset = offset
                    if fut is not None and not fut.done():
                        fut.set_result(offset)
                self._out.put_nowait([event for event, _ in batch])
            self._idle.set()
            if self._closed:
                await self._end_call()
                self._out.put_nowait(None)
                return

    async def _append(self, events: list[events_pb2.Event]) -> list[str]:
        """Appends one batch on the write call (opened, or replaced, as needed); returns its offsets.
        The first batch of a sink awaiting its turn's start is held by the stream service until then."""
        awaiting = self.started is not None and not self.started.done()
        request = stream_service_pb2.WriteStreamRequest(key=self.key, events=events, await_start=awaiting)
        for attempt in range(2):
            call = self._call
            if call is not None and call.done() and (call.answered or not call.sent):
                call.cancel()
                call = None  # it ended with nothing unanswered: write on a new one
            if call is None:
                call = self._call = _WriteCall(self.clients)
            try:
                resp = await call.send(request)
                offsets = list(resp.offsets)
            except grpc.aio.AioRpcError as exc:
                self._call = None
                call.cancel()
                if attempt == 0 and isinstance(from_rpc_error(exc), Shutdown):
                    continue  # the service stopped before it took the batch: send it elsewhere
                raise
            if len(offsets) != len(events) or (awaiting and not resp.HasField("start")):
                self._call = None
                call.cancel()
                raise Internal(f"the stream service answered a batch of {len(events)} events wrongly")
            if awaiting and self.started is not None and not self.started.done():
                self.started.set_result(resp.start)
            return offsets
        raise Shutdown(f"the stream service kept shutting down under the writer of {self.key}")

    async def _end_call(self) -> None:
        call, self._call = self._call, None
        if call is not None:
            await call.end(5.0)

    def _fail(self, err: MeshError, batch: list[_Entry]) -> None:
        self._failure = err
        if self.started is not None and not self.started.done():
            self.started.set_exception(err)
        for _, fut in batch + self._pending:
            if fut is not None and not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._idle.set()
        self._out.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def flush(self) -> None:
        """Waits until everything emitted so far is stored (raises the append error, if any)."""
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


class _WriteCall(AskCall):
    """One WriteStream call: `send` a batch, get its answer (its offsets)."""

    def __init__(self, clients: Clients) -> None:
        super().__init__(clients.stream.WriteStream)
        self.sent = False  # a batch went on it
        self.answered = False  # it answered a batch: it worked, so it may be replaced once it ends

    async def send(
        self, request: stream_service_pb2.WriteStreamRequest
    ) -> stream_service_pb2.WriteStreamResponse:
        """The batch's answer; the call's AioRpcError when it ended first (after the batch was sent
        or before)."""
        self.sent = True
        resp = await self.ask(request)
        if resp is grpc.aio.EOF:
            raise Internal("the stream service ended a write call before it answered the batch")
        self.answered = True
        return resp  # type: ignore[no-any-return]
