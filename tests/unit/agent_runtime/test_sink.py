"""EventSink, the single ordered writer of a stream key: batching, offsets, failure, close (against an
in-process stand-in for StreamService.WriteStream, which holds each answer until the test opens a gate;
the real service is covered by tests/stream/test_write_stream.py and the mesh suites)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest

from agentmesh.stream.v1 import stream_service_pb2 as ss
from libs import events
from libs.errors import Cancelled, Unavailable
from services.agent_runtime.sink import EventSink


@dataclass
class _Stream:
    batches: list[list[str]] = field(default_factory=list)
    fail_with: grpc.StatusCode | None = None
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    n: int = 0

    calls: int = 0

    def WriteStream(self, requests: AsyncIterator[ss.WriteStreamRequest]) -> _Call:
        self.calls += 1
        return _Call(self, aiter(requests))


@dataclass
class _Call:
    """The reader side of a bidi call: each read answers the next request, once the gate is open."""

    stream: _Stream
    requests: AsyncIterator[ss.WriteStreamRequest]
    ended: bool = False

    async def read(self) -> ss.WriteStreamResponse:
        request = await anext(self.requests)
        await self.stream.gate.wait()
        if self.stream.fail_with is not None:
            self.ended = True
            raise grpc.aio.AioRpcError(self.stream.fail_with, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")
        self.stream.batches.append([e.text_delta.text_delta for e in request.events])
        offsets = []
        for _ in request.events:
            self.stream.n += 1
            offsets.append(f"{self.stream.n:05d}")
        return ss.WriteStreamResponse(offsets=offsets)

    def done(self) -> bool:
        return self.ended

    async def code(self) -> grpc.StatusCode:
        with contextlib.suppress(StopAsyncIteration):
            await anext(self.requests)  # the writer's half-close
        self.ended = True
        return grpc.StatusCode.OK

    def cancel(self) -> bool:
        self.ended = True
        return True


@dataclass
class _Clients:
    stream: _Stream


async def test_events_queued_while_a_write_is_in_flight_go_in_one_batch() -> None:
    stream = _Stream()
    sink = EventSink(_Clients(stream), "session:x")  # type: ignore[arg-type]
    sink.emit(events.text_delta("a"))
    await asyncio.sleep(0)  # the writer takes "a" and waits on the gate
    for t in "bcd":
        sink.emit(events.text_delta(t))
    stream.gate.set()
    stored = sink.store(events.text_delta("e"))
    assert await stored == "00005"
    await sink.aclose()
    assert stream.batches == [["a"], ["b", "c", "d", "e"]]
    assert stream.calls == 1  # one write call carried both batches
    got = [b async for b in sink.committed()]
    assert [[e.offset for e in b] for b in got] == [["00001"], ["00002", "00003", "00004", "00005"]]


async def test_a_closed_buffer_under_the_writer_means_cancelled() -> None:
    stream = _Stream(fail_with=grpc.StatusCode.FAILED_PRECONDITION)
    stream.gate.set()
    sink = EventSink(_Clients(stream), "session:x")  # type: ignore[arg-type]
    with pytest.raises(Cancelled):
        await sink.store(events.text_delta("a"))
    assert isinstance(sink.failure, Cancelled)
    sink.emit(events.text_delta("dropped"))  # after a failure nothing more is written
    with pytest.raises(Cancelled):
        await sink.flush()
    assert [b async for b in sink.committed()] == []


async def test_an_unavailable_stream_service_fails_the_sink() -> None:
    stream = _Stream(fail_with=grpc.StatusCode.UNAVAILABLE)
    stream.gate.set()
    sink = EventSink(_Clients(stream), "a2a:t")  # type: ignore[arg-type]
    sink.emit(events.text_delta("a"))
    with pytest.raises(Unavailable):
        await sink.flush()
