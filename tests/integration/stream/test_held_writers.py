"""WriteStreams writers held for their turn's `start` (WriteStreamRequest.await_start: a run started
before its turn was stored), over real gRPC on the memory and Redis backends: a writer whose buffer is
created late waits for it, then for the start; one whose buffer never comes, or shows anything but the
start first, fails alone with a clear reason and nothing of it is appended. (Held writers beside other
writers, and EventSinks awaiting their start: test_writes.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from agentmesh.libs import events
from agentmesh.services.stream import backend as stream_backend
from tests.integration.stream.conftest import StreamHarness, append, close, collect, create, info
from tests.integration.stream.test_writes import Writes, _start, batch, texts
from tests.mesh import wait_until


async def test_a_held_writer_waits_for_its_buffer_to_be_created(
    stream: StreamHarness, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started beside its buffer's CreateStream: its first batch finds no buffer yet; the service
    waits for the buffer to be created, then for the turn's `start`, and appends the batch after it."""
    looked = asyncio.Event()
    waits = stream_backend._create_waits

    def counted() -> Iterator[float | None]:
        for i, pause in enumerate(waits()):
            if i == 1:
                looked.set()  # one look found no buffer
            yield pause

    monkeypatch.setattr(stream_backend, "_create_waits", counted)
    key = f"session:{unique}"
    writes = Writes(stream)
    writes.send(batch(1, "before", key=key, await_start=True))
    await asyncio.wait_for(looked.wait(), 10)
    await create(stream, key)
    await append(stream, key, [_start(unique)])
    held = await writes.answer(1)
    assert held.answer.start.assistant_message_id == 7 and len(held.answer.offsets) == 1
    # Once started, await_start on an empty batch answers at once (nothing appended).
    writes.send(batch(1, await_start=True))
    again = await writes.answer(1, 2)
    assert again.answer.start.assistant_message_id == 7 and list(again.answer.offsets) == []
    assert await writes.end() == grpc.StatusCode.OK
    await close(stream, key)
    assert [events.kind(e) for e in await collect(stream, key)] == ["start", "reasoning_delta", "done"]


async def test_a_held_writer_of_a_buffer_never_created_fails_not_found(
    stream: StreamHarness, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No buffer comes within CREATE_WAIT_S: NOT_FOUND, nothing stored, the call goes on."""
    monkeypatch.setattr(stream_backend, "CREATE_WAIT_S", 0.2)
    key = f"session:{unique}"
    writes = Writes(stream)
    writes.send(batch(1, "x", key=key, await_start=True))
    assert (await writes.answer(1)).error_reason == "NOT_FOUND"
    assert await writes.end() == grpc.StatusCode.OK
    assert not (await info(stream, key)).exists


@pytest.mark.parametrize(("first", "reason"), [("closed", "CANCELLED"), ("other", "FAILED_PRECONDITION")])
async def test_a_held_writer_is_refused_when_its_buffer_shows_anything_else_first(
    stream: StreamHarness, unique: str, first: str, reason: str
) -> None:
    """The turn failed to begin (its buffer closed) or someone else wrote first: the held batch is
    never appended and its writer fails with a clear reason."""
    key = f"session:{unique}"
    await create(stream, key)
    writes = Writes(stream)
    writes.send(batch(1, "never", key=key, await_start=True))
    await wait_until(lambda: stream.backend.subscribers == 1, what="the service holds the batch")
    assert (await info(stream, key)).length == 0  # held: nothing appended yet
    if first == "closed":
        await close(stream, key)
    else:
        await append(stream, key, [events.reasoning_delta("someone else")])
    assert (await writes.answer(1)).error_reason == reason
    assert await writes.end() == grpc.StatusCode.OK
    assert "never" not in texts(await collect(stream, key, idle_timeout_ms=200))
