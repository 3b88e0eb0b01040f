"""Appends to many Redis buffers at once share one round trip (services/stream/redis_batch.py): they
reach Redis on one connection, one after the other, and each caller still gets its own offsets or its
own error, also after Redis forgot the scripts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from agentmesh.libs import events
from agentmesh.libs.config import StreamSettings
from agentmesh.libs.errors import FailedPrecondition, NotFound
from agentmesh.services.stream.redis_backend import RedisBackend

pytestmark = pytest.mark.redis

OWNER = "batch-user"


@pytest.fixture
async def backend(redis_url: str, unique: str) -> AsyncIterator[RedisBackend]:
    b = RedisBackend(redis_url, StreamSettings(backend="redis"), prefix=f"test:{unique}:")
    await b.start()
    yield b
    keys = [k async for k in b.client.scan_iter(match=f"test:{unique}:*")]
    if keys:
        await b.client.delete(*keys)
    await b.aclose()


async def _buffers(backend: RedisBackend, unique: str, n: int) -> list[str]:
    keys = [f"trace:{unique}-{i}" for i in range(n)]
    for key in keys:
        await backend.create(key, OWNER)
    return keys


async def test_appends_made_together_go_as_one_pipeline(backend: RedisBackend, unique: str) -> None:
    """Twenty appends started in one pass of the loop: Redis runs their scripts on one connection,
    and each buffer holds its own event."""
    keys = await _buffers(backend, unique, 20)
    seen: list[tuple[int, str]] = []
    async with backend.client.monitor() as monitor:
        watching = asyncio.ensure_future(_evalshas(monitor, f"test:{unique}:", 20, seen))
        offsets = await asyncio.gather(
            *(backend.append(key, [events.text_delta(f"to {key}")], OWNER) for key in keys)
        )
        await asyncio.wait_for(watching, 10)
    assert [len(o) for o in offsets] == [1] * 20
    assert len({port for port, _ in seen}) == 1, seen  # one connection: one pipeline
    assert sorted(key for _, key in seen) == sorted(f"test:{unique}:meta:{k}" for k in keys)
    for key, (offset,) in zip(keys, offsets, strict=True):
        info = await backend.info(key)
        assert (info.length, info.last_offset) == (1, offset)


async def _evalshas(monitor: object, prefix: str, n: int, seen: list[tuple[int, str]]) -> None:
    while len(seen) < n:
        command = await monitor.next_command()  # type: ignore[attr-defined]
        parts = command["command"].split()
        if parts and parts[0].upper() == "EVALSHA" and len(parts) > 3 and parts[3].startswith(prefix):
            seen.append((command["client_port"], parts[3]))


async def test_each_caller_gets_its_own_error(backend: RedisBackend, unique: str) -> None:
    """In one batch: an append to a closed buffer fails with FAILED_PRECONDITION, one to a missing
    buffer with NOT_FOUND, and the others are stored."""
    keys = await _buffers(backend, unique, 4)
    await backend.end(keys[1], [], events.done(), OWNER)
    results = await asyncio.gather(
        *(backend.append(key, [events.text_delta("x")], OWNER) for key in [*keys, f"trace:{unique}-gone"]),
        return_exceptions=True,
    )
    assert isinstance(results[1], FailedPrecondition), results
    assert isinstance(results[4], NotFound), results
    assert all(isinstance(r, list) and len(r) == 1 for r in (results[0], results[2], results[3])), results


async def test_a_batch_after_redis_forgot_the_scripts(backend: RedisBackend, unique: str) -> None:
    """SCRIPT FLUSH (a restarted Redis): the next batch's calls are loaded and sent again, stored once."""
    keys = await _buffers(backend, unique, 5)
    await asyncio.gather(*(backend.append(key, [events.text_delta("a")], OWNER) for key in keys))
    await backend.client.script_flush()
    offsets = await asyncio.gather(*(backend.append(key, [events.text_delta("b")], OWNER) for key in keys))
    assert [len(o) for o in offsets] == [1] * 5
    for key in keys:
        assert (await backend.info(key)).length == 2  # a, then b: each once
