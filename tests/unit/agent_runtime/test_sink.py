"""EventSink, the single ordered writer of a stream key: batching, offsets, failure, close (against an
in-process stand-in for StreamService.AppendEvents; the real one is covered by the mesh suites)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

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

    async def AppendEvents(self, request: ss.AppendEventsRequest, **_: Any) -> ss.AppendEventsResponse:
        await self.gate.wait()
        if self.fail_with is not None:
            raise grpc.aio.AioRpcError(self.fail_with, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")
        self.batches.append([e.text_delta.text_delta for e in request.events])
        offsets = []
        for _ in request.events:
            self.n += 1
            offsets.append(f"{self.n:05d}")
        return ss.AppendEventsResponse(offsets=offsets)


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
