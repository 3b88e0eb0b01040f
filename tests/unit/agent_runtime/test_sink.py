"""EventSink, the single ordered writer of a stream key: batching, offsets, deferred answers, failure,
close (against an in-process stand-in for StreamService.WriteStream that reads the requests in a task
of its own, as gRPC does, takes each batch once the test opens a gate, and answers only the batches
that ask; the real service is covered by tests/stream/test_write_stream.py and the mesh suites)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from agentmesh.stream.v1 import stream_service_pb2 as ss
from libs import events
from libs.errors import Cancelled, Unavailable
from services.agent_runtime.sink import EventSink
from tests.mesh import wait_until


@dataclass
class _Stream:
    batches: list[list[str]] = field(default_factory=list)
    deferred: list[bool] = field(default_factory=list)  # per batch: sent with defer_answer
    fail_with: grpc.StatusCode | None = None  # the next batch taken ends the call with this
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    n: int = 0
    calls: int = 0
    taken: int = 0  # requests read off the call (waiting at the gate, or stored)
    answers: int = 0

    def WriteStream(self, requests: AsyncIterator[ss.WriteStreamRequest]) -> _Call:
        self.calls += 1
        return _Call(self, requests)


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "no")


class _Call:
    """The caller's side of a bidi call: the stand-in server takes the requests in its own task."""

    def __init__(self, stream: _Stream, requests: AsyncIterator[ss.WriteStreamRequest]) -> None:
        self.stream = stream
        self.answers: asyncio.Queue[Any] = asyncio.Queue()
        self.callbacks: list[Any] = []
        self.ended = False
        self.task = asyncio.ensure_future(self._serve(requests))

    async def _serve(self, requests: AsyncIterator[ss.WriteStreamRequest]) -> None:
        taken: list[str] = []
        try:
            async for request in requests:
                self.stream.taken += 1
                await self.stream.gate.wait()
                if self.stream.fail_with is not None:
                    self._end(
                        grpc.aio.AioRpcError(
                            self.stream.fail_with, grpc.aio.Metadata(), grpc.aio.Metadata(), "no"
                        )
                    )
                    return
                self.stream.batches.append([e.text_delta.text_delta for e in request.events])
                self.stream.deferred.append(request.defer_answer)
                for _ in request.events:
                    self.stream.n += 1
                    taken.append(f"{self.stream.n:05d}")
                if not request.defer_answer:
                    self.stream.answers += 1
                    self.answers.put_nowait(ss.WriteStreamResponse(offsets=taken))
                    taken = []
            self._end(grpc.aio.EOF)
        except asyncio.CancelledError:
            self._end(
                grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata())
            )

    def _end(self, final: Any) -> None:
        if not self.ended:
            self.ended = True
            self.answers.put_nowait(final)
            for callback in self.callbacks:
                callback(self)

    async def read(self) -> Any:
        item = await self.answers.get()
        if isinstance(item, grpc.aio.AioRpcError) or item is grpc.aio.EOF:
            self.answers.put_nowait(item)  # the end stays the end
            if item is not grpc.aio.EOF:
                raise item
        return item

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Any]:
        while (item := await self.read()) is not grpc.aio.EOF:
            yield item

    def done(self) -> bool:
        return self.ended

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def cancel(self) -> bool:
        if self.ended:
            return False
        self.task.cancel()
        return True


@dataclass
class _Clients:
    stream: _Stream
    settings: Any = field(default_factory=lambda: SimpleNamespace(stream_rpc_timeout_s=3600.0))


def _sink(stream: _Stream, call_timeout_s: float = 3600.0, **kw: Any) -> EventSink:
    clients = _Clients(stream, SimpleNamespace(stream_rpc_timeout_s=call_timeout_s))
    return EventSink(clients, "session:x", **kw)  # type: ignore[arg-type]


async def test_events_queued_while_a_write_is_in_flight_go_in_one_batch() -> None:
    stream = _Stream()
    sink = _sink(stream)
    sink.emit(events.text_delta("a"))
    await wait_until(lambda: stream.taken == 1, what="the stand-in holds the first batch")
    for t in "bcd":  # the stand-in holds "a" (gRPC is writing it): these wait for the next batch
        sink.emit(events.text_delta(t))
    stream.gate.set()
    stored = sink.store(events.text_delta("e"))
    assert await stored == "00005"
    await sink.aclose()
    assert stream.batches == [["a"], ["b", "c", "d", "e"]]
    assert stream.deferred == [True, False]  # nobody waited for "a"'s offset; store() asked
    assert (stream.calls, stream.answers) == (1, 1)  # one call, one answer for both batches
    got = [b async for b in sink.committed()]
    assert [[e.offset for e in b] for b in got] == [["00001"], ["00002", "00003", "00004", "00005"]]


async def test_batches_nobody_waits_for_go_unanswered_and_land_in_order() -> None:
    """At a model's pace every delta is its own batch: each goes without an answer, and the close
    asks once for all of them; committed() still yields every batch with its offsets, in order."""
    stream = _Stream()
    stream.gate.set()
    sink = _sink(stream)
    for i in range(10):
        sink.emit(events.text_delta(f"{i}"))
        await wait_until(lambda i=i: len(stream.batches) == i + 1, what=f"batch {i} taken")
    assert stream.answers == 0
    await sink.flush()  # an empty batch asks: everything before it is stored
    assert stream.answers == 1 and stream.batches[-1] == []
    sink.emit(events.text_delta("last"))
    await sink.aclose()
    assert sink.failure is None
    assert stream.batches == [[f"{i}"] for i in range(10)] + [[], ["last"]]
    assert stream.deferred == [True] * 10 + [False, False]  # the close's last batch asked
    got = [e for b in [b async for b in sink.committed()] for e in b]
    assert [e.text_delta.text_delta for e in got] == [f"{i}" for i in range(10)] + ["last"]
    assert [e.offset for e in got] == [f"{n:05d}" for n in range(1, 12)]


async def test_a_call_holds_a_bounded_number_of_unanswered_batches() -> None:
    """Every 64th batch in a row asks for its answer (the writer does not wait for it): what a sink
    holds for its answers stays bounded however long the run."""
    stream = _Stream()
    stream.gate.set()
    sink = _sink(stream)
    for i in range(70):
        sink.emit(events.text_delta(f"{i}"))
        await wait_until(lambda i=i: len(stream.batches) == i + 1, what=f"batch {i} taken")
    assert [i for i, deferred in enumerate(stream.deferred) if not deferred] == [63]
    assert stream.answers == 1
    assert sink._call is not None and len(sink._call.unanswered) == 6
    await sink.aclose()
    got = [e for b in [b async for b in sink.committed()] for e in b]
    assert [e.offset for e in got] == [f"{n:05d}" for n in range(1, 71)]


async def test_a_call_is_replaced_before_its_deadline() -> None:
    """A write call past half its deadline (stream_rpc_timeout_s) carries one more batch, asking for
    its answer, and ends; the next batch goes on a new call (no batch is left unanswered at the
    deadline, where it could be neither resent nor known stored)."""
    stream = _Stream()
    stream.gate.set()
    sink = _sink(stream, call_timeout_s=0.2)
    sink.emit(events.text_delta("a"))
    await wait_until(lambda: len(stream.batches) == 1, what="the first batch taken")
    await asyncio.sleep(0.15)  # the call's life (0.1 s) passes
    sink.emit(events.text_delta("b"))
    await wait_until(lambda: sink._call is None, what="the old call retired")
    sink.emit(events.text_delta("c"))
    await sink.aclose()
    assert sink.failure is None
    assert stream.batches == [["a"], ["b"], ["c"]] and stream.deferred == [True, False, False]
    assert stream.calls == 2


async def test_a_live_sink_asks_for_every_answer() -> None:
    """`live` (RunAgent streaming its events with their offsets): each batch is yielded once stored."""
    stream = _Stream()
    stream.gate.set()
    sink = _sink(stream, live=True)
    batches = sink.committed()
    sink.emit(events.text_delta("a"))
    first = await asyncio.wait_for(anext(batches), 5)
    assert [e.offset for e in first] == ["00001"] and stream.deferred == [False]
    await sink.aclose()


async def test_a_failure_on_an_unanswered_batch_fails_the_sink_unasked() -> None:
    """The buffer closed under the writer while its batches went unanswered: the call's status alone
    tells, and the sink fails (the run ends with its terminal event) without waiting for anything."""
    stream = _Stream()
    stream.gate.set()
    sink = _sink(stream)
    sink.emit(events.text_delta("kept"))
    await wait_until(lambda: len(stream.batches) == 1, what="the first batch taken")
    stream.fail_with = grpc.StatusCode.FAILED_PRECONDITION
    sink.emit(events.text_delta("refused"))
    failure = await wait_until(lambda: sink.failure, what="the sink to learn of the failure")
    assert isinstance(failure, Cancelled)
    assert stream.answers == 0 and stream.deferred == [True]
    sink.emit(events.text_delta("dropped"))
    with pytest.raises(Cancelled):
        await sink.flush()
    assert [b async for b in sink.committed()] == []  # no answer said what was stored
    assert stream.batches == [["kept"]]


async def test_a_closed_buffer_under_the_writer_means_cancelled() -> None:
    stream = _Stream(fail_with=grpc.StatusCode.FAILED_PRECONDITION)
    stream.gate.set()
    sink = _sink(stream)
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
    sink = _sink(stream, live=False)
    sink.emit(events.text_delta("a"))
    with pytest.raises(Unavailable):
        await sink.flush()
    with contextlib.suppress(Exception):
        await sink.aclose()
