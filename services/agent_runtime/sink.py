"""EventSink: the single ordered writer of one stream key.

`emit(event)` queues an event and returns at once; a writer task appends queued events to the
stream service in batches (one AppendEvents RPC for everything that queued up while the previous
one was in flight), so per-delta work on the hot path is a list append. `committed()` yields the
stored batches, events carrying their offsets, in order. `await sink.store(e)` when the caller
must know the event is durable before going on (a2a-task-started before the callee starts).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from agentmesh.events.v1 import events_pb2
from agentmesh.stream.v1 import stream_service_pb2
from libs.clients import Clients
from libs.errors import Cancelled, MeshError, from_rpc_error

_MAX_BATCH = 256
_Entry = tuple[events_pb2.Event, "asyncio.Future[str] | None"]  # a future only where someone waits


class EventSink:
    def __init__(self, clients: Clients, key: str) -> None:
        self.clients = clients
        self.key = key
        self._pending: list[_Entry] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()  # nothing queued and nothing in flight
        self._idle.set()
        self._out: asyncio.Queue[list[events_pb2.Event] | None] = asyncio.Queue()
        self._closed = False
        self._failure: MeshError | None = None
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

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch, self._pending = self._pending[:_MAX_BATCH], self._pending[_MAX_BATCH:]
                try:
                    resp = await self.clients.stream.AppendEvents(
                        stream_service_pb2.AppendEventsRequest(key=self.key, events=[e for e, _ in batch])
                    )
                except grpc.aio.AioRpcError as exc:
                    err = from_rpc_error(exc)
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        # Someone closed the buffer under a running writer: the run was cancelled.
                        err = Cancelled(f"{self.key} was closed: {err.message}")
                    self._fail(err, batch)
                    return
                for (event, fut), offset in zip(batch, resp.offsets, strict=True):
                    event.offset = offset
                    if fut is not None and not fut.done():
                        fut.set_result(offset)
                self._out.put_nowait([event for event, _ in batch])
            self._idle.set()
            if self._closed:
                self._out.put_nowait(None)
                return

    def _fail(self, err: MeshError, batch: list[_Entry]) -> None:
        self._failure = err
        for _, fut in batch + self._pending:
            if fut is not None and not fut.done():
                fut.set_exception(err)
        self._pending.clear()
        self._idle.set()
        self._out.put_nowait(None)

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
        self._idle.set()
        self._out.put_nowait(None)

    async def committed(self) -> AsyncIterator[list[events_pb2.Event]]:
        while True:
            batch = await self._out.get()
            if batch is None:
                return
            yield batch
