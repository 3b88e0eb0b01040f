"""Hostile `from_offset`s: a malformed offset is INVALID_ARGUMENT on both backends, never INTERNAL.

Memory offsets are 1-20 ASCII digits; Redis offsets are entry ids `ms[-seq]`, each part 1-20 ASCII digits
that fit in 64 bits (Redis refuses bigger ones, which must not surface as an internal error).
"""

from __future__ import annotations

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.errors import MeshError
from agentmesh.services.stream.memory import MemoryBackend
from tests.integration.stream.conftest import StreamHarness, append, close, collect, create, deltas

U64 = 2**64 - 1

HOSTILE = {
    "5000-digits": "9" * 5000,
    "superscript-two": "\u00b2",  # str.isdigit() is true for these
    "arabic-indic-digits": "\u0661\u0662\u0663",
    "fullwidth-digits": "\uff11\uff12\uff13",
    "three-parts": "1-2-3",
    "21-digits": "9" * 21,
    "21-digit-seq": "1-" + "9" * 21,
    "negative": "-1",
    "trailing-dash": "1-",
    "hex": "0x10",
    "exponent": "1e5",
    "space": " 12",
    "newline": "12\n",
    "nul": "12\x00",
}


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
@pytest.mark.parametrize("offset", list(HOSTILE.values()), ids=list(HOSTILE))
async def test_hostile_offset_is_invalid_argument(
    stream: StreamHarness, unique: str, offset: str, closed: bool
) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    await append(stream, key, deltas("a"))
    if closed:
        await close(stream, key)
    for kw in ({}, {"terminal_only": True}):
        with pytest.raises(MeshError) as err:
            await collect(stream, key, reader="alice", from_offset=offset, idle_timeout_ms=100, **kw)
        assert err.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT, err.value.message
        assert "invalid offset" in err.value.message
        assert len(err.value.message) < 200  # the offset is not echoed whole
    assert stream.backend.subscribers == 0


# Offsets each backend's grammar reads differently: what memory accepts, Redis may refuse.
EDGES = {
    "20-nines": "9" * 20,  # memory: a number; Redis: above 2^64-1
    "u64-plus-one": str(U64 + 1),
    "u64": str(U64),
    "max-entry-id": f"{U64}-{U64}",  # Redis: no entry can follow it
    "redis-id": "1700000000000-0",
    "zero": "0",
    "zero-padded-20": "0" * 20,
}


def _position(offset: str) -> tuple[int, int]:
    ms, _, seq = offset.partition("-")
    return int(ms), int(seq or 0)


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
@pytest.mark.parametrize("offset", list(EDGES.values()), ids=list(EDGES))
async def test_edge_offset_is_never_internal(
    stream: StreamHarness, unique: str, offset: str, closed: bool
) -> None:
    """Either the subscription runs (replaying what follows the offset) or the offset is INVALID_ARGUMENT;
    on Redis, an offset from before the buffer was made (not zero, which reads from the start) is an
    earlier buffer's: NOT_FOUND."""
    key = f"trace:{unique}"
    await create(stream, key)
    await append(stream, key, deltas("a"))
    if closed:
        await close(stream, key)
    buffered = await collect(stream, key, reader="alice", idle_timeout_ms=100)  # everything, from the start
    memory = isinstance(stream.backend, MemoryBackend)
    parts = offset.split("-")
    if memory:
        valid = len(parts) == 1
    else:
        valid = all(int(p) <= U64 for p in parts) and offset != f"{U64}-{U64}"
    earlier = not memory and valid and (0, 0) < _position(offset) < _position(buffered[0].offset)
    try:
        got = await collect(stream, key, reader="alice", from_offset=offset, idle_timeout_ms=100)
    except MeshError as exc:
        if earlier:
            assert exc.grpc_code == grpc.StatusCode.NOT_FOUND, exc.message
            return
        assert exc.grpc_code == grpc.StatusCode.INVALID_ARGUMENT, exc.message
        assert not valid, f"{offset!r} refused: {exc.message}"
        return
    assert valid and not earlier, f"{offset!r} accepted"
    expected = [e.offset for e in buffered if e.offset and _position(e.offset) > _position(offset)]
    assert [e.offset for e in got if e.offset] == expected
    if not closed:  # nothing more comes: the open buffer's subscription idles out
        assert events.kind(got[-1]) == "error" and got[-1].error.code == ev.ERROR_CODE_IDLE_TIMEOUT
    assert stream.backend.subscribers == 0


async def test_an_offset_of_an_earlier_buffer_of_the_key_is_not_found(
    stream: StreamHarness, unique: str
) -> None:
    """A reader resuming from an offset of an earlier buffer of its key (closed and made again by the
    next turn; or, on memory, lost with a restarted process) is refused NOT_FOUND, instead of reading
    the new buffer's events as the continuation of the old one's (offsets grow across buffers: Redis
    keeps a replaced stream's last id, memory starts a buffer's offsets from the clock, above its key's
    previous buffer)."""
    key = f"trace:{unique}"
    await create(stream, key)
    (old,) = await append(stream, key, deltas("old"))
    await close(stream, key)
    await create(stream, key)  # the next turn's buffer replaces the closed one
    new = await append(stream, key, deltas("new 1", "new 2"))
    with pytest.raises(MeshError) as err:
        await collect(stream, key, reader="alice", from_offset=old, idle_timeout_ms=100)
    assert err.value.grpc_code == grpc.StatusCode.NOT_FOUND, err.value.message
    assert "earlier buffer" in err.value.message
    got = await collect(stream, key, reader="alice", from_offset=new[0], idle_timeout_ms=100)
    assert [e.offset for e in got if e.offset] == new[1:]  # its own offsets resume as before
    assert stream.backend.subscribers == 0
