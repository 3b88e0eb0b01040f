"""The memory backend's caps on the closed buffers it holds (AGENTMESH_STREAM__MAX_CLOSED_BUFFERS and
__MAX_CLOSED_BYTES): past either, the oldest closed buffer goes first, before its TTL, counted in the
eviction metrics; open buffers are never evicted; an evicted buffer reads exactly like an expired one.
"""

from __future__ import annotations

import grpc
import pytest

from agentmesh.libs.errors import MeshError
from agentmesh.services.stream.memory import MemoryBackend
from tests.integration.stream.conftest import (
    StreamFactory,
    StreamHarness,
    append,
    close,
    collect,
    create,
    deltas,
    info,
)

pytestmark = pytest.mark.parametrize("backend_kind", ["memory"], indirect=True)


def sample(h: StreamHarness, name: str, **labels: str) -> float:
    value = h.server.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


async def not_found(h: StreamHarness, key: str, **kw: str) -> str:
    """The message of the NOT_FOUND a reader of `key` gets."""
    with pytest.raises(MeshError) as err:
        await collect(h, key, reader="alice", idle_timeout_ms=100, **kw)
    assert err.value.grpc_code == grpc.StatusCode.NOT_FOUND, err.value.message
    return err.value.message


async def test_past_the_count_cap_the_oldest_closed_go_first(
    stream_factory: StreamFactory, unique: str
) -> None:
    h = await stream_factory(max_closed_buffers=2, ttl_s=60, lease_s=120)
    assert h.clock is not None
    keys = [f"trace:{unique}-{i}" for i in range(4)]
    for key in [*keys, f"trace:{unique}-open"]:
        await create(h, key)
        await append(h, key, deltas(key))
    order = [keys[2], keys[0], keys[3], keys[1]]  # closed in another order than created
    sizes, offsets = {}, {}
    for key in order:
        await close(h, key)
        got = await collect(h, key, reader="alice")
        sizes[key], offsets[key] = sum(e.ByteSize() for e in got), got[0].offset
    # Each close past the cap evicted the buffer closed longest ago; the open one stays.
    assert [(await info(h, key)).exists for key in order] == [False, False, True, True]
    assert (await info(h, f"trace:{unique}-open")).exists
    assert h.backend.stats().closed_buffers == 2
    assert sample(h, "agentmesh_stream_buffers_evicted_total", cap="buffers") == 2
    assert sample(h, "agentmesh_stream_buffers_evicted_total", cap="bytes") == 0
    assert sample(h, "agentmesh_stream_evicted_bytes_total") == sizes[order[0]] + sizes[order[1]]
    await h.backend.refresh_metrics()
    assert sample(h, "agentmesh_stream_closed_buffers") == 2
    assert sample(h, "agentmesh_stream_closed_bytes") == sizes[order[2]] + sizes[order[3]]
    assert sample(h, "agentmesh_stream_buffers_open") == 1

    # An evicted buffer answers as an expired one: from the start and from one of its own offsets.
    evicted = order[0]
    evicted_answers = [await not_found(h, evicted), await not_found(h, evicted, from_offset=offsets[evicted])]
    expired = order[2]
    h.clock.advance(61)
    assert isinstance(h.backend, MemoryBackend) and h.backend.sweep() == 2
    assert not (await info(h, expired)).exists
    expired_answers = [await not_found(h, expired), await not_found(h, expired, from_offset=offsets[expired])]
    assert [m.replace(evicted, "KEY") for m in evicted_answers] == [
        m.replace(expired, "KEY") for m in expired_answers
    ]
    assert h.backend.stats().closed_buffers == 0
    assert (await info(h, f"trace:{unique}-open")).exists


async def test_the_closed_bytes_stay_under_their_cap(stream_factory: StreamFactory, unique: str) -> None:
    cap = 5_000
    h = await stream_factory(max_closed_bytes=cap)
    big = f"trace:{unique}-big"  # open, and over the closed cap by itself: never evicted while open
    await create(h, big)
    await append(h, big, deltas(*["y" * 1000] * 8))
    keys = [f"trace:{unique}-{i}" for i in range(6)]
    for key in keys:
        await create(h, key)
        await append(h, key, deltas("x" * 1000))
        await close(h, key)
        assert 0 < h.backend.stats().closed_bytes <= cap
    held = [key for key in keys if (await info(h, key)).exists]
    assert held == keys[-len(held) :] and 2 <= len(held) < len(keys)  # the newest, in one run
    evicted = len(keys) - len(held)
    assert sample(h, "agentmesh_stream_buffers_evicted_total", cap="bytes") == evicted
    assert sample(h, "agentmesh_stream_buffers_evicted_total", cap="buffers") == 0
    got = await collect(h, big, reader="alice", idle_timeout_ms=100)
    assert "".join(e.text_delta.text_delta for e in got) == "y" * 8000

    await close(h, big)  # closed, it alone passes the cap: it goes at once, and the others stay
    assert not (await info(h, big)).exists
    assert [key for key in keys if (await info(h, key)).exists] == held
    assert sample(h, "agentmesh_stream_buffers_evicted_total", cap="bytes") == evicted + 1
