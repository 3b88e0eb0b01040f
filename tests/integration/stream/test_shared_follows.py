"""Shared follows (libs/streams/fanout.py) over a real stream service (memory and Redis): the readers of
one key and user share one subscription of the service, each reads from its own offset, and every
ending reaches every reader (docs/design/streams.md#shared-follows)."""

from __future__ import annotations

import asyncio

import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.errors import Interrupted, MeshError, NotFound
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import ServiceServer
from agentmesh.libs.streams import fanout as fanout_module
from agentmesh.libs.streams.fanout import Fanout, Reader
from agentmesh.libs.streams.follower import FollowCancelled
from agentmesh.libs.streams.reconnect import went_away
from agentmesh.services.stream.backend import StreamBackend
from agentmesh.services.stream.memory import MemoryBackend
from agentmesh.services.stream.redis_backend import RedisBackend
from agentmesh.services.stream.server import build
from tests.integration.stream.conftest import StreamFactory, StreamHarness, append, close, create
from tests.mesh import wait_until


def reader(fanout: Fanout, key: str, user: str = "alice", **kw: object) -> Reader:
    with identity.acting_as(user):
        return fanout.follow(key, **kw)  # type: ignore[arg-type]


def marks(n: int, start: int = 0) -> list[ev.Event]:
    return [events.reasoning_delta(f"r{i}") for i in range(start, start + n)]  # not coalesced


class Collected:
    """A reader read to its end by a task: its events, and its failure (None: it ended with its
    terminal event)."""

    def __init__(self, follow: Reader) -> None:
        self.follow = follow
        self.events: list[ev.Event] = []
        self.error: MeshError | None = None
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async for event in self.follow:
                self.events.append(event)
        except MeshError as err:
            self.error = err

    @property
    def offsets(self) -> list[str]:
        return [e.offset for e in self.events]


async def append_read(h: StreamHarness, key: str, n: int, start: int, by: Collected) -> list[str]:
    """Appends `n` events one at a time, each once `by` read the one before (so that it stays within
    what the shared follow keeps)."""
    offsets = []
    for i in range(start, start + n):
        offsets += await append(h, key, marks(1, i))
        await wait_until(lambda count=i + 1: len(by.events) == count, 10, f"event {i}")
    return offsets


async def read_all(*readers: Collected) -> None:
    await asyncio.wait_for(asyncio.gather(*(r.task for r in readers)), 20)


async def test_readers_of_one_key_share_one_subscription(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    early = await append(stream, key, marks(3))
    fanout = Fanout(stream.follows)
    readers = [Collected(reader(fanout, key)) for _ in range(5)]
    await wait_until(lambda: all(len(r.events) == 3 for r in readers), 10, "the replay")
    live = await append(stream, key, marks(3, 3))
    await wait_until(lambda: all(len(r.events) == 6 for r in readers), 10, "the live events")
    assert stream.backend.subscribers == 1, "one subscription serves the five readers"
    assert fanout.shared_follows() == 1
    done = (await close(stream, key)).offset
    await read_all(*readers)
    for r in readers:
        assert r.error is None
        assert r.offsets == early + live + [done]
        assert r.events[-1].HasField("done")
        assert r.events == readers[0].events
    await wait_until(lambda: stream.backend.subscribers == 0, 5, "the subscription to end")
    assert fanout.shared_follows() == 0


async def test_readers_from_other_offsets_each_get_their_whole_sequence(
    stream: StreamHarness, unique: str
) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    early = await append(stream, key, marks(6))
    fanout = Fanout(stream.follows)
    first = Collected(reader(fanout, key))
    await wait_until(lambda: len(first.events) == 6, 10, "the first reader's replay")
    # Readers resuming inside what the shared follow keeps, and one from the start (still kept).
    resumed = {offset: Collected(reader(fanout, key, from_offset=offset)) for offset in (early[1], early[5])}
    again = Collected(reader(fanout, key))
    assert all(r.follow.shared for r in [first, again, *resumed.values()])
    late = await append(stream, key, marks(2, 6))
    done = (await close(stream, key)).offset
    await read_all(first, again, *resumed.values())
    assert first.offsets == again.offsets == early + late + [done]
    assert resumed[early[1]].offsets == early[2:] + late + [done]
    assert resumed[early[5]].offsets == [*late, done]
    assert stream.backend.subscribers == 0


async def test_a_reader_from_an_offset_not_kept_catches_up_on_its_own(
    stream: StreamHarness, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shared follow keeps its latest RECENT events: a reader resuming before them (or from the start
    once they moved on) reads a follow of its own until its last event is among the newer half of the
    kept ones, then reads on the shared follow; each gets its whole sequence."""
    monkeypatch.setattr(fanout_module, "RECENT", 4)
    key = f"trace:{unique}"
    await create(stream, key)
    fanout = Fanout(stream.follows)
    first = Collected(reader(fanout, key))
    early = await append_read(stream, key, 8, 0, first)  # kept: early[4:], after early[3]
    start, old = Collected(reader(fanout, key)), Collected(reader(fanout, key, from_offset=early[1]))
    kept = Collected(reader(fanout, key, from_offset=early[3]))
    assert not start.follow.shared and not old.follow.shared and kept.follow.shared
    await wait_until(lambda: start.follow.shared and old.follow.shared, 10, "the own follows to catch up")
    await wait_until(lambda: stream.backend.subscribers == 1, 5, "the own follows to end")
    late = await append_read(stream, key, 2, 8, first)
    done = (await close(stream, key)).offset
    await read_all(first, start, old, kept)
    assert start.offsets == first.offsets == early + late + [done]
    assert old.offsets == early[2:] + late + [done]
    assert kept.offsets == early[4:] + late + [done]


async def test_a_reader_that_cancels_leaves_the_others_reading(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    fanout = Fanout(stream.follows)
    readers = [Collected(reader(fanout, key)) for _ in range(3)]
    early = await append(stream, key, marks(2))
    await wait_until(lambda: all(len(r.events) == 2 for r in readers), 10, "the first events")
    leaving, *staying = readers
    leaving.follow.cancel()
    await read_all(leaving)
    assert isinstance(leaving.error, FollowCancelled)
    later = await append(stream, key, marks(2, 2))
    await wait_until(lambda: all(len(r.events) == 4 for r in staying), 10, "the later events")
    assert stream.backend.subscribers == 1 and fanout.shared_follows() == 1
    assert leaving.offsets == early
    for r in staying:  # the last one to leave ends the subscription
        r.follow.cancel()
    await read_all(*staying)
    assert all(isinstance(r.error, FollowCancelled) and r.offsets == early + later for r in staying)
    await wait_until(lambda: stream.backend.subscribers == 0, 5, "the subscription to end")
    assert fanout.shared_follows() == 0


async def test_a_slow_reader_moves_to_its_own_follow(
    stream: StreamHarness, unique: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader RECENT events behind the shared follow does not hold the others: it reads on from its
    last event on a follow of its own, nothing missed and nothing twice."""
    monkeypatch.setattr(fanout_module, "RECENT", 4)
    key = f"trace:{unique}"
    await create(stream, key)
    fanout = Fanout(stream.follows)
    fast, slow = reader(fanout, key), reader(fanout, key)
    fast_read = Collected(fast)
    first = await append(stream, key, marks(2))
    slow_events = [await anext(slow), await anext(slow)]
    more = await append_read(stream, key, 10, 2, fast_read)
    assert slow.shared and stream.backend.subscribers == 1
    slow_events.append(await anext(slow))
    assert not slow.shared
    done = (await close(stream, key)).offset
    slow_events += [e async for e in slow]
    await read_all(fast_read)
    assert fast_read.offsets == [e.offset for e in slow_events] == first + more + [done]


async def test_users_never_share_a_follow(stream: StreamHarness, unique: str) -> None:
    """Each user's readers are checked by the service as that user: bob's reader of alice's buffer is
    refused even while alice's readers follow it, and the mesh's reader has a subscription of its own."""
    mine, bobs = f"trace:{unique}-a", f"trace:{unique}-b"
    await create(stream, mine, owner="alice")
    await create(stream, bobs, owner="bob")
    fanout = Fanout(stream.follows)
    alice = Collected(reader(fanout, mine))
    mine_first = await append(stream, mine, marks(1))
    await wait_until(lambda: len(alice.events) == 1, 10, "alice's reader")
    nosy = Collected(reader(fanout, mine, user="bob"))
    await read_all(nosy)
    assert isinstance(nosy.error, NotFound) and nosy.events == []
    bob = Collected(reader(fanout, bobs, user="bob"))
    mesh = Collected(reader(fanout, mine, user=""))
    bobs_first = await append(stream, bobs, marks(1))
    await wait_until(lambda: len(bob.events) == 1 and len(mesh.events) == 1, 10, "bob's and the mesh's")
    assert stream.backend.subscribers == 3 and fanout.shared_follows() == 3
    mine_done, bobs_done = (await close(stream, mine)).offset, (await close(stream, bobs)).offset
    await read_all(alice, bob, mesh)
    assert alice.offsets == mesh.offsets == [*mine_first, mine_done]
    assert bob.offsets == [*bobs_first, bobs_done]


def the_same_buffers(h: StreamHarness, request: pytest.FixtureRequest) -> StreamBackend:
    """A backend for a stream service that comes back in the harness's place: on Redis, over the buffers
    of the one that went (on memory, with none)."""
    if isinstance(h.backend, RedisBackend):
        redis_url = request.getfixturevalue("redis_url")
        return RedisBackend(redis_url, h.settings.stream, prefix=h.backend.prefix)
    return MemoryBackend(h.settings.stream)


async def restart(h: StreamHarness, backend: StreamBackend, signer: Signer) -> ServiceServer:
    """Stops the harness's stream service, then serves `backend` at its address."""
    await h.server.stop(1.0)
    again = await build(h.settings, h.server.target, backend, signer)
    await again.start()
    await asyncio.wait_for(h.channel.channel_ready(), 10)
    return again


async def test_a_restart_of_the_stream_service_reaches_every_reader(
    stream_factory: StreamFactory, unique: str, request: pytest.FixtureRequest, signer: Signer
) -> None:
    """On Redis, the shared follow goes on from its last event once the service is back, and each reader
    gets every event once; on memory, the buffer is gone with it and every reader ends `interrupted`."""
    h = await stream_factory()
    key = f"trace:{unique}"
    await create(h, key)
    fanout = Fanout(h.follows)
    readers = [Collected(reader(fanout, key)) for _ in range(3)]
    early = await append(h, key, marks(2))
    await wait_until(lambda: all(len(r.events) == 2 for r in readers), 10, "the first events")
    redis = isinstance(h.backend, RedisBackend)
    backend = the_same_buffers(h, request)
    again = await restart(h, backend, signer)
    try:
        if not redis:
            await read_all(*readers)
            assert all(isinstance(r.error, Interrupted) and r.offsets == early for r in readers)
            return
        later = await append(h, key, marks(2, 2))
        done = (await close(h, key)).offset
        await read_all(*readers)
        assert all(r.error is None and r.offsets == early + later + [done] for r in readers)
    finally:
        await again.stop(1.0)
        await backend.aclose()


async def test_a_stream_service_that_stays_away_ends_every_reader(
    stream_factory: StreamFactory, unique: str
) -> None:
    h = await stream_factory()  # its follows give up after a second (Reconnect(..., 1.0))
    key = f"trace:{unique}"
    await create(h, key)
    fanout = Fanout(h.follows)
    readers = [Collected(reader(fanout, key)) for _ in range(3)]
    await append(h, key, marks(1))
    await wait_until(lambda: all(len(r.events) == 1 for r in readers), 10, "the first event")
    await h.server.stop(1.0)
    await read_all(*readers)
    assert all(went_away(r.error) for r in readers), [r.error for r in readers]  # SHUTDOWN or UNAVAILABLE
    assert fanout.shared_follows() == 0
